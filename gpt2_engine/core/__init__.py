"""The model: config, weights and their loader, tokenizer, quantized formats, how a projection runs (projection.py),
the forward math (model.py), hook points, LoRA's format, the numpy reference and the native kernels. It imports
nothing outside core/; runtime/ and train/ build on it.

Reading order: numpy_ref.py (the whole forward in numpy), then model.py, then runtime/greedy.py."""
