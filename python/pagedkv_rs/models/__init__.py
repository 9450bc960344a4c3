"""Model support: GGUF loading, the GGUF tokenizer, and the Llama forward pass."""
