"""Reading chat output: tool-call parsers (hermes, llama3_json, mistral, forced by
tool_choice), reasoning parsers, tool rendering for chat templates."""
