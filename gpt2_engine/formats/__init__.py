"""File formats: Hugging Face checkpoints, nanoGPT, llm.c, GGUF, token shards, PEFT adapters, SAE files."""
