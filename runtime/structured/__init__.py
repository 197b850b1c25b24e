"""Constrained decoding (structured outputs) with xgrammar, split by role: ``params`` and
``bitmask`` are plain records; ``config`` and ``limits`` settings; ``compiler`` (compile pool),
``manager`` (matchers, bitmask fill) and ``request_grammar`` (one request's compile future and
matcher) run in the engine core. The front's validation is
``front/structured_validate``, the worker's mask apply ``worker/grammar_mask``."""
