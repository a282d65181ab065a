"""`gpt2 serve`'s server: an OpenAI-compatible completions API over the engine loop (continuous batching).

protocol.py (request/response models), serving.py (requests to engine work and back), async_engine.py (the engine
loop on a thread of its own, with per-request queues), metrics.py (Prometheus text), app.py (routes). The command
itself is commands/serve.py.
"""
