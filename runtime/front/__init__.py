"""The front process's text side: tokenizer and chat templates (content tokenized with special
tokens split), incremental detokenizer and output processing (stop strings, ``n > 1``
fan-out), request and structured-output validation, and the front's view of LoRA adapters.
``frontend`` (``Frontend``) composes the text pipeline; ``AsyncEngine`` and the offline ``LLM``
each hold one. Runs beside the server's event loop (or the offline ``LLM``); never in the
engine core."""
