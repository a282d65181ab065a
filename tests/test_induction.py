"""Finding the heads a trained model's copying depends on, with the engine's own tools alone.

The checkpoint (scripts/train_induction.py, cached like the other fixtures) is a 2-layer GPT-2 trained on
<|endoftext|>, a random prefix, then a random token run repeated twice, until it predicts the second run. Such a model
need not grow a textbook induction head (previous-token head in layer 0, induction head in layer 1), and this one does
not: the tests pin what it does. Ablating any one of its four layer-0 heads (its slice of hook_z set to zero through
run_with_hooks) costs the second run several nats; no layer-1 head costs one. The two layer-0 heads the copying leans
on most read the first run broadly from second-run tokens (most of their attention, and most of their strongest keys,
are in it), but their strongest key is almost never the induction target (the token after the current token's first
occurrence), and the standard detectors on random repeated runs score every head low. Two training seeds here gave
the same picture, with the heads permuted.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import train_induction as recipe  # scripts/, on the path through conftest
from conftest import engine

from gpt2_engine import GPT2
from gpt2_engine.inspect import head_scores


@pytest.fixture(scope="module")
def copier(induction_dir: Path) -> GPT2:
    return engine(induction_dir)


@pytest.fixture(scope="module")
def held_out() -> tuple[torch.Tensor, torch.Tensor]:
    """64 sequences of the training distribution the model never saw, and where the second run is predictable."""
    return recipe.batch(torch.Generator().manual_seed(123), 64)


def second_run_loss(model: GPT2, ids: torch.Tensor, scored: torch.Tensor, hooks: dict | None = None) -> float:
    return float(recipe.second_run_loss(model.run_with_hooks(ids, hooks or {}), ids, scored))


def ablation_rises(model: GPT2, ids: torch.Tensor, scored: torch.Tensor) -> dict[tuple[int, int], float]:
    """(layer, head) -> how much the second-run loss rises when that head's output is zeroed."""
    base = second_run_loss(model, ids, scored)

    def zero_head(h: int):
        def hook(z: torch.Tensor, name: str) -> torch.Tensor:
            z = z.clone()
            z[:, :, h] = 0.0  # [B, T, nh, hs]: head h writes nothing
            return z
        return hook

    return {(layer, h): second_run_loss(model, ids, scored, {f"blocks.{layer}.attn.hook_z": zero_head(h)}) - base
            for layer in range(model.config.n_layer) for h in range(model.config.n_head)}


@pytest.mark.slow
def test_the_model_copies_the_second_run(copier: GPT2, held_out) -> None:
    ids, scored = held_out
    assert second_run_loss(copier, ids, scored) < 1.0  # nats; uniform over the pool would be log(200) = 5.3
    filler = torch.zeros_like(scored)
    filler[:, 45:-1] = True  # after the longest sequence: random filler, unpredictable
    assert float(recipe.second_run_loss(copier(ids), ids, filler)) > 4.0


@pytest.mark.slow
@pytest.mark.long
def test_ablation_finds_the_heads_the_copying_depends_on(copier: GPT2, held_out) -> None:
    ids, scored = held_out
    rises = ablation_rises(copier, ids, scored)
    important = {head for head, rise in rises.items() if rise > 2.0}
    assert important == {(0, 0), (0, 1), (0, 2), (0, 3)}, rises  # every layer-0 head, no layer-1 head
    assert max(rises[(1, h)] for h in range(4)) < 1.0, rises

    # what the detectors say about them: no textbook previous-token or induction head anywhere
    pool = recipe.POOL.tolist()
    scores = {kind: head_scores(copier, kind, vocab=pool, run_length=20)
              for kind in ("previous_token", "duplicate_token", "induction")}
    for kind, s in scores.items():
        assert s.max() < 0.3, (kind, s)

    # what the patterns of the two heads it leans on most say, from second-run tokens: most of the attention is on the
    # first run, and so is the strongest key of most queries, but that key is rarely the induction target
    _, cache = copier.run_with_cache(ids, lambda name: name.endswith("hook_pattern"))
    for layer, h in sorted(important, key=rises.get)[-2:]:
        mass, strongest_in_run, strongest_is_target, queries = 0.0, 0, 0, 0
        for b in range(ids.shape[0]):
            q = scored[b].nonzero()[:, 0]  # second-run positions whose next token is predictable
            n = len(q) + 1
            first = q[0] - n  # the first run is [first, first + n)
            p = cache[f"blocks.{layer}.attn.hook_pattern"][b, h, q]  # [n - 1, S]
            strongest = p.argmax(-1)  # [n - 1]
            mass += float(p[:, first : first + n].sum())
            strongest_in_run += int(((strongest >= first) & (strongest < first + n)).sum())
            strongest_is_target += int((strongest == q - n + 1).sum())
            queries += len(q)
        assert mass / queries > 0.6 and strongest_in_run / queries > 0.6, (layer, h, mass / queries)
        assert strongest_is_target / queries < 0.15, (layer, h, strongest_is_target / queries)
