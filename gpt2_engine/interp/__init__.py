"""Interpretability on the one forward: hook names and caches, sparse autoencoders, steering."""
