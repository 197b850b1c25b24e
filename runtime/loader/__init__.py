"""Model loading: HF directories, hub ids, GGUF files (reader and one-time conversion), the
embedded default model, bundled configs for dummy weights, and the model's generation config.
Runs where the model is built (worker) and, for tokenizer and config facts, in the front."""
