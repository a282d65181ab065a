"""Scaling out on Ray (the optional `distributed` extra): `gpt2 serve --ray` (serve.py) and `gpt2 score --ray`
(score.py). Both run the same engine code as the local commands; Ray only places and feeds the copies."""
