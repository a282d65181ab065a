"""`gpt2 serve`: an OpenAI-compatible completions server over the engine's scheduler (continuous batching).

protocol.py (request/response models), serving.py (requests to engine work and back), engine.py (the engine
thread), metrics.py (Prometheus text), app.py (routes), cli.py (the command).
"""
