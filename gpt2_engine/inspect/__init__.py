"""Look inside GPT-2: analyses over the engine's hook points (analysis.py) and `gpt2 inspect`'s report (report.py)."""

from .analysis import (
                       Attribution,
                       LogitAttribution,
                       LogitLens,
                       attribution,
                       direct_logit_attribution,
                       head_scores,
                       lens_logits,
                       logit_lens,
)

__all__ = ["Attribution", "LogitAttribution", "LogitLens", "attribution", "direct_logit_attribution", "head_scores",
           "lens_logits", "logit_lens"]
