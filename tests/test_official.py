"""Opt-in: the real openai-community/gpt2 weights in weights/ (put there by `make weights` or by hand)."""

from __future__ import annotations

import pytest
import torch
from conftest import OFFICIAL_WEIGHTS

from gpt2_engine import GPT2
from gpt2_engine.download import PINNED_SHA256, file_digests

pytestmark = pytest.mark.official

HAS_WEIGHTS = (OFFICIAL_WEIGHTS / "config.json").is_file() and any(
    (OFFICIAL_WEIGHTS / name).is_file() for name in ("model.safetensors", "pytorch_model.bin"))
needs_weights = pytest.mark.skipif(
    not HAS_WEIGHTS, reason="the official GPT-2 weights are not in weights/ (run `make weights` to enable these tests)")


@pytest.fixture(scope="module")
def official() -> GPT2:
    return GPT2.from_pretrained(OFFICIAL_WEIGHTS)


@needs_weights
def test_files_are_the_official_ones() -> None:
    checked = 0
    for name, sha256 in PINNED_SHA256.items():
        if (OFFICIAL_WEIGHTS / name).is_file():
            assert file_digests(OFFICIAL_WEIGHTS / name)[0] == sha256, name
            checked += 1
    assert checked >= 4  # config.json, a weights file, vocab.json, merges.txt


@needs_weights
def test_greedy_the_dog_matches_the_golden_ids(official: GPT2) -> None:
    # transformers' own GPT-2 integration test: greedy from "The dog", max_length 20
    golden = [464, 3290, 373, 1043, 287, 257, 2214, 1474, 262, 16246, 286, 2688, 290, 2688, 27262, 13, 198, 198, 464, 3290]
    prompt = official.tokenizer.encode("The dog")
    assert prompt == golden[:2]
    assert prompt + official.generate_ids(prompt, max_new_tokens=18, temperature=0) == golden


@needs_weights
def test_logits_match_transformers_on_the_official_weights(official: GPT2) -> None:
    from transformers import GPT2LMHeadModel

    hf = GPT2LMHeadModel.from_pretrained(OFFICIAL_WEIGHTS, dtype=torch.float32).eval()
    ids = torch.tensor([official.tokenizer.encode("Hello, my dog is cute and he likes to play fetch in the park.")])
    with torch.no_grad():
        ref = hf(ids).logits
    mine = official(ids)
    assert (mine - ref).abs().max().item() <= 1e-4 * ref.abs().max().item()
    assert torch.equal(mine.argmax(-1), ref.argmax(-1))
