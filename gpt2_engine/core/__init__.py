"""The engine core: config, weights, tokenizer, the forward math, sampling and generation. Tools import from here."""
