"""Reading chat output: tool-call parsers (hermes, qwen3_coder, pythonic, deepseek_v3,
openai/Harmony, granite, llama3_json, mistral, forced by tool_choice), reasoning parsers,
tool rendering for chat templates, and the structural tag that constrains ``auto`` calls."""
