"""The engine's logits against transformers' GPT2LMHeadModel on the full-size official-layout fixture."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpt2_engine import GPT2
from gpt2_engine.commands.compare import reference_outputs
from gpt2_engine.core import numpy_ref
from gpt2_engine.core.weights import assemble, named_tensors

# Relative tolerances, as a fraction of max |reference|: float32 rounding over 12 blocks measures ~1e-6.
TORCH_RTOL = 1e-4
NUMPY_RTOL = 1e-3


def assert_close(found: torch.Tensor, ref: torch.Tensor, rtol: float, what: str) -> None:
    diff = (found.float() - ref.float()).abs()
    scale = ref.abs().max().item()
    worst = diff.max().item()
    where = np.unravel_index(int(diff.argmax()), tuple(diff.shape))
    assert worst <= rtol * scale, f"{what}: max |diff| {worst:.3g} at {where} > {rtol} x max |ref| {scale:.3g}"


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("length", [1, 7, 64, pytest.param(1024, marks=[pytest.mark.slow, pytest.mark.long])])
def test_logits_match_transformers(model: GPT2, hf_model, batch: int, length: int) -> None:
    ids = torch.randint(0, model.config.vocab_size, (batch, length), generator=torch.Generator().manual_seed(length))
    ref, ref_blocks = reference_outputs(hf_model, ids)
    blocks: list[torch.Tensor] = []
    logits = model.forward(ids, hidden_states=blocks)

    assert logits.shape == (batch, length, model.config.vocab_size) and logits.dtype == torch.float32
    assert_close(logits, ref, TORCH_RTOL, "logits")
    assert torch.equal(logits.argmax(-1), ref.argmax(-1))
    assert len(blocks) == len(ref_blocks) == model.config.n_layer
    for i, (mine, theirs) in enumerate(zip(blocks, ref_blocks)):
        assert_close(mine, theirs, TORCH_RTOL, f"hidden state after block {i}")


def test_pytorch_bin_gives_the_same_logits(small_dir, small_bin_dir, model: GPT2) -> None:
    from_bin = GPT2.from_pretrained(small_bin_dir)
    ids = torch.randint(0, 50257, (2, 33), generator=torch.Generator().manual_seed(1))
    assert torch.equal(from_bin(ids), model(ids))


@pytest.mark.parametrize("length", [5, 300])
def test_numpy_reference_matches_torch(model: GPT2, length: int) -> None:
    ids = torch.randint(0, 50257, (1, length), generator=torch.Generator().manual_seed(2))
    torch_blocks: list[torch.Tensor] = []
    logits = model.forward(ids, hidden_states=torch_blocks)[0].numpy()
    np_blocks: list[np.ndarray] = []
    plain = assemble(named_tensors(model.weights), model.config)  # the (K, N) matrices, whichever layout is kept
    ref = numpy_ref.forward(plain, model.config, ids[0].numpy(), hidden_states=np_blocks)
    assert ref.shape == logits.shape
    assert_close(torch.from_numpy(ref), torch.from_numpy(logits), NUMPY_RTOL, "numpy logits")
    assert np.array_equal(ref.argmax(-1), logits.argmax(-1))
    for i, (a, b) in enumerate(zip(np_blocks, torch_blocks)):
        assert_close(torch.from_numpy(a), b[0], NUMPY_RTOL, f"numpy block {i}")


def test_causality_future_tokens_change_no_earlier_logit(model: GPT2) -> None:
    ids = torch.randint(0, 50257, (1, 40), generator=torch.Generator().manual_seed(3))
    changed = ids.clone()
    changed[0, 25] = (changed[0, 25] + 1) % 50257
    a, b = model(ids), model(changed)
    assert torch.equal(a[:, :25], b[:, :25])  # bit-identical before the change
    assert not torch.allclose(a[:, 25], b[:, 25])  # and the change is seen from position 25 on


def test_batch_rows_are_independent(model: GPT2) -> None:
    ids = torch.randint(0, 50257, (3, 20), generator=torch.Generator().manual_seed(4))
    batched = model(ids)
    for b in range(3):
        assert_close(batched[b], model(ids[b : b + 1])[0], 1e-5, f"row {b}")


def test_any_config_of_the_architecture_matches(tiny_model: GPT2, tiny_hf_model) -> None:
    assert (tiny_model.config.n_layer, tiny_model.config.n_head, tiny_model.config.n_embd) == (2, 4, 64)
    ids = torch.randint(0, 50257, (2, 128), generator=torch.Generator().manual_seed(5))
    ref, _ = reference_outputs(tiny_hf_model, ids)
    assert_close(tiny_model(ids), ref, TORCH_RTOL, "tiny logits")


@pytest.mark.parametrize(
    "bad, message",
    [
        (torch.zeros(3, dtype=torch.long), "expected an integer tensor of shape [B, T]"),
        (torch.zeros(1, 3), "expected an integer tensor of shape [B, T], got torch.float32"),
        (torch.zeros(1, 0, dtype=torch.long), "expected at least one token"),
        (torch.full((1, 2), 50257), "token id 50257 is outside the vocabulary [0, 50257)"),
        (torch.full((1, 2), -1), "token id -1 is outside the vocabulary"),
        (torch.zeros(1, 1025, dtype=torch.long), "1025 tokens exceed the context length 1024"),
        (torch.zeros(1, 2, dtype=torch.long).to_sparse(), "expected a dense tensor of token ids, got a sparse_coo one"),
        (torch.zeros(1, 2, dtype=torch.long, device="meta"), "expected a dense tensor of token ids, got a meta one"),
    ],
)
def test_bad_ids_are_refused_with_a_message(model: GPT2, bad: torch.Tensor, message: str) -> None:
    from gpt2_engine import GPT2EngineError

    with pytest.raises(GPT2EngineError) as e:
        model(bad)
    assert message in str(e.value)


def test_a_batch_whose_logits_cannot_fit_is_refused_before_the_forward(model: GPT2) -> None:
    """model(ids) for 200,000 x 128 tokens asked torch for 77 GB and failed with its allocator's message."""
    from gpt2_engine import GPT2EngineError

    ids = torch.zeros(1, 1, dtype=torch.long).expand(200_000, 128)
    with pytest.raises(GPT2EngineError, match=r"^ids of shape \[200000, 128\] need ~[\d,.]+ GB for a forward pass's "
                                              r"activations; this process has [\d.]+ GB available: at most \d+ rows "
                                              r"fit$"):
        model(ids)
