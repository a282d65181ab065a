"""The native decode path of a pass (kernels/block.cpp): a block and the head as one call each, against model.py's
torch functions; their row invariance; the per-row logsumexp and argmax the scheduler reads; the quantized model's
embedding rows read from the file; a pass's embedding as one call."""

from __future__ import annotations

import math
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from gpt2_engine import GPT2
from gpt2_engine.core.kernels import decode_kernels
from gpt2_engine.core.ops import FEW_IDS, embed
from gpt2_engine.core.model import KVCache, logits
from gpt2_engine.core.projection import reduce_rows
from gpt2_engine.runtime.rows import RowLayout, embeds_natively, native_embed
from gpt2_engine.runtime.plan import Picks, Segment
from gpt2_engine.runtime.runner import NO_ADAPTERS, Pass, native_rows, rows_block
from gpt2_engine.runtime.sampling import argmax

VARIANTS = {"float32": {}, "bfloat16": {"dtype": "bfloat16"}, "int8": {"quantize": "int8"}, "int4": {"quantize": "int4"}}


@pytest.fixture(scope="module")
def models(trained_dir: Path) -> dict[str, GPT2]:
    assert decode_kernels() is not None, "the native kernels did not build (see the warning above)"
    return {name: GPT2.from_pretrained(trained_dir, **kwargs) for name, kwargs in VARIANTS.items()}


def filled_cache(model: GPT2, slots: int, seed: int) -> KVCache:
    g = torch.Generator().manual_seed(seed)
    cache = KVCache.allocate(model.config, slots, 64)
    cache.k.copy_(torch.randn(cache.k.shape, generator=g))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g))
    return cache


@pytest.mark.parametrize("name", list(VARIANTS))
def test_row_block_matches_the_torch_block(models: dict[str, GPT2], name: str) -> None:
    """Each block as one native call gives model.block()'s result on the same kernels, to float32 rounding (its layer
    norm and GELU are its own), and writes the rows' keys and values where the torch block writes them."""
    model = models[name]
    w, cfg = model.weights, model.config
    native = native_rows(w, cfg)
    assert native is not None
    layout = RowLayout.of([(2, 7, 1), (0, 0, 3), (1, 30, 2)])  # a decode row, a short prompt, two drafted rows
    x = torch.randn(1, 6, cfg.n_embd, generator=torch.Generator().manual_seed(1))
    for i in range(cfg.n_layer):
        ours, ref = filled_cache(model, 3, i), filled_cache(model, 3, i)
        got = native.blocks[i](x, ours.k, ours.v, layout.slots, layout.positions, NO_ADAPTERS)  # [1, 6, C]
        with torch.inference_mode():
            expected = rows_block(w, cfg, i, x, layout, ref)
        # measured up to 3.5e-7 of the largest value in the four formats (layer norm and GELU rounding apart)
        assert got.shape == expected.shape and (got - expected).abs().max() <= 1e-6 * expected.abs().max(), i
        for a, b in ((ours.k, ref.k), (ours.v, ref.v)):  # the new rows' keys and values (from ln_1's output)
            assert (a - b).abs().max() <= 2e-7 * b.abs().max(), i  # measured up to 7.8e-8
            assert torch.equal(a[:, :, :, 40:], b[:, :, :, 40:])  # nothing past the rows' positions is touched


@pytest.fixture(scope="module")
def narrow_mlp_dir(trained_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint whose config sets n_inner (the MLP's width, 4C in GPT-2) to 1.5C, written by transformers."""
    from transformers import GPT2Config as HFConfig, GPT2LMHeadModel

    torch.manual_seed(0)
    hf = GPT2LMHeadModel(HFConfig(n_layer=2, n_head=4, n_embd=64, n_inner=96, n_positions=64, initializer_range=0.2))
    directory = tmp_path_factory.mktemp("narrow_mlp")
    hf.eval().save_pretrained(directory)
    for name in ("vocab.json", "merges.txt"):
        shutil.copy(trained_dir / name, directory / name)
    return directory


@pytest.mark.parametrize("name", ["float32", "int8"])
def test_a_block_of_another_mlp_width_runs_natively(narrow_mlp_dir: Path, name: str) -> None:
    """The native block cuts its buffers to the config's MLP width: a model with n_inner = 1.5C decodes natively,
    each block equal to the torch block, and (float32) with transformers' greedy tokens."""
    from transformers import GPT2LMHeadModel

    model = GPT2.from_pretrained(narrow_mlp_dir, **VARIANTS[name])
    w, cfg = model.weights, model.config
    native = native_rows(w, cfg)
    assert cfg.mlp_width == 96 and native is not None
    layout = RowLayout.of([(2, 7, 1), (0, 0, 3)])
    x = torch.randn(1, 4, cfg.n_embd, generator=torch.Generator().manual_seed(2))
    for i in range(cfg.n_layer):
        ours, ref = filled_cache(model, 3, i), filled_cache(model, 3, i)
        got = native.blocks[i](x, ours.k, ours.v, layout.slots, layout.positions, NO_ADAPTERS)
        with torch.inference_mode():
            expected = rows_block(w, cfg, i, x, layout, ref)
        assert (got - expected).abs().max() <= 1e-6 * expected.abs().max(), i
    if name == "float32":
        ids = [464, 2068, 7586]
        hf = GPT2LMHeadModel.from_pretrained(narrow_mlp_dir, dtype=torch.float32).eval()
        theirs = hf.generate(torch.tensor([ids]), max_new_tokens=8, min_new_tokens=8, do_sample=False)[0, 3:].tolist()
        assert model.generate_ids(ids, max_new_tokens=8, temperature=0, ignore_eos=True) == theirs


@pytest.mark.parametrize("name", list(VARIANTS))
def test_row_head_matches_logits(models: dict[str, GPT2], name: str) -> None:
    model = models[name]
    w, cfg = model.weights, model.config
    x = torch.randn(5, cfg.n_embd, generator=torch.Generator().manual_seed(2)) * 3
    got = native_rows(w, cfg).head(x)  # [5, V]
    with torch.inference_mode():
        expected = logits(w, cfg, x)
    # measured up to 3.9e-7 of the largest logit (the layer norm's rounding)
    assert got.shape == (5, cfg.vocab_size) and (got - expected).abs().max() <= 1e-6 * expected.abs().max()
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


@pytest.mark.parametrize("name", list(VARIANTS))
def test_a_rows_logits_do_not_depend_on_its_neighbours(models: dict[str, GPT2], name: str) -> None:
    """A sequence's logits from a native pass are the same bits alone as among other sequences' rows."""
    model = models[name]
    w, cfg = model.weights, model.config
    prompts = [[464, 2068, 7586], [15496, 11], [40, 716, 257, 3290, 290]]
    together, alone = KVCache.allocate(cfg, 3, 32), KVCache.allocate(cfg, 3, 32)
    both = Pass(w, cfg, together, [Segment(s, 0, p) for s, p in enumerate(prompts)])
    while not both.done:
        both.run_block()
    rows = both.logits()  # [3, V]
    for s, p in enumerate(prompts):
        one = Pass(w, cfg, alone, [Segment(s, 0, p)])
        while not one.done:
            one.run_block()
        assert torch.equal(one.logits()[0], rows[s])


@pytest.mark.parametrize("name", ["float32", "int4"])
def test_a_pass_writes_logits_only_for_segments_that_read_them(models: dict[str, GPT2], name: str) -> None:
    """Pass.outputs: a greedy segment's rows come back as picks only (token, logit, logsumexp), equal to reducing the
    pass's own logits; a sampling segment's rows also as logits, the same bits as Pass.logits()."""
    model = models[name]
    w, cfg = model.weights, model.config
    segments = [Segment(0, 0, [464, 2068, 7586], greedy=True, banned=50256), Segment(1, 0, [15496, 11], outputs=2),
                Segment(2, 0, [40, 716], outputs=2, greedy=True)]

    def run() -> Pass:
        p = Pass(w, cfg, KVCache.allocate(cfg, 3, 32), segments)
        while not p.done:
            p.run_block()
        return p

    full = run().logits()  # [5, V]
    out = run().outputs()
    assert torch.equal(out.logits, full[1:3])
    assert out.picks == reduce_rows(full, [50256, -1, -1, -1, -1])
    assert out.picks.tokens[2:] == full[2:].argmax(-1).tolist()
    greedy_only = Pass(w, cfg, KVCache.allocate(cfg, 3, 32), [segments[0], segments[2]])
    while not greedy_only.done:
        greedy_only.run_block()
    only = greedy_only.outputs()
    assert only.logits.shape == (0, cfg.vocab_size) and only.picks.tokens == out.picks.tokens[:1] + out.picks.tokens[3:]


def test_reduce_rows_matches_torch() -> None:
    """Each row's logsumexp within float32 rounding of torch's in float64, its argmax torch's (the first of equal
    maxima) with the banned token skipped, and the same values for a row alone as among others, strided or not."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 50257, generator=g) * 4
    x[1, 300] = x[1, 40000] = x[1].max() + 1  # a tie: the first wins
    x[2, 50256] = x[2].max() + 1  # the banned token holds the max: the next largest wins
    picks = Picks(*reduce_rows(x, [-1, -1, 50256, 7]))
    expected = torch.logsumexp(x.double(), -1)
    # measured up to 1.2e-7 of |lse| (~19 here, where a float32 step is 1.9e-6)
    assert all(abs(a - b) <= 4e-7 * abs(b) for a, b in zip(picks.lse, expected.tolist()))
    allowed = x.clone()
    allowed[2, 50256] = allowed[3, 7] = -math.inf
    assert picks.tokens == allowed.argmax(-1).tolist() and picks.tokens[1] == 300
    assert picks.logit == [float(x[i, t]) for i, t in enumerate(picks.tokens)]
    alone = [Picks(*reduce_rows(r[None], [b])) for r, b in zip(x, [-1, -1, 50256, 7])]
    assert [a.lse[0] for a in alone] == picks.lse and [a.tokens[0] for a in alone] == picks.tokens
    strided = torch.randn(50257, 3, generator=g).t()  # rows of a transposed tensor: stride (1, 3)
    assert reduce_rows(strided) == reduce_rows(strided.contiguous())
    edge = torch.tensor([[-math.inf] * 40, [0.0] * 39 + [math.nan], [1.0] * 37 + [math.inf] * 3])
    e = Picks(*reduce_rows(edge))
    assert e.lse[0] == -math.inf and math.isnan(e.lse[1]) and e.lse[2] == math.inf
    assert e.tokens[0] == -1 and e.tokens[1] == -1 and e.tokens[2] == 37
    assert reduce_rows(torch.tensor([[2.5]])) == ([0], [2.5], [2.5])


@pytest.mark.parametrize("name", list(VARIANTS))
def test_the_heads_greedy_picks_are_its_logits_reduced(models: dict[str, GPT2], name: str) -> None:
    """RowHead.select: the kept rows' logits are the head's own bits, every row's picks those of reduce_rows over
    the head's logits, whatever rows share the call and however many threads run it; greedy rows' logits unwritten."""
    model = models[name]
    head = native_rows(model.weights, model.config).head
    x = torch.randn(6, model.config.n_embd, generator=torch.Generator().manual_seed(5))
    full = head(x)  # [6, V]
    banned = [-1, 50256, -1, -1, 50256, -1]
    keep = [-1, 0, -1, 1, -1, -1]
    tokens, best, lse, kept = head.select(x, banned, keep, 2)
    assert torch.equal(kept, full[[1, 3]])
    assert (tokens, best, lse) == reduce_rows(full, banned)
    one = head.select(x[4:5].contiguous(), banned[4:5], [-1], 0)
    assert one[3].shape == (0, model.config.vocab_size)
    assert (one[0], one[1], one[2]) == ([tokens[4]], [best[4]], [lse[4]])
    with pytest.raises(RuntimeError, match="expected a banned token and a keep place for each of the 6 rows"):
        head.select(x, banned[:5], keep, 2)
    with pytest.raises(RuntimeError, match="keep numbers past kept"):
        head.select(x, banned, keep, 1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert head.select(x, banned, keep, 2)[2] == lse
    finally:
        torch.set_num_threads(threads)


def test_argmax_is_torchs() -> None:
    """The first of equal largest values, a NaN counting as the largest, as torch.argmax."""
    assert argmax(torch.tensor([1.0, 3.0, 3.0, -1.0])) == 1
    assert argmax(torch.tensor([1.0, math.nan, 5.0, math.nan])) == int(torch.tensor([1.0, math.nan, 5.0, math.nan]).argmax())
    x = torch.randn(50257, 3).t()[1]  # a strided row
    assert argmax(x) == int(x.argmax())


def test_a_quantized_model_reads_its_embedding_rows_from_the_file(models: dict[str, GPT2]) -> None:
    """A decode step's few ids are read with pread (no pages of the float32 wte get mapped); the rows are wte's."""
    w = models["int8"].weights
    assert w.wte_pages is not None and w.wte_pages.path.endswith("model.safetensors")
    ids = torch.tensor([[0, 464, 50256], [7, 7, 31]])
    assert torch.equal(w.wte_pages.read_rows(w.wte, ids.view(-1).tolist()), w.wte[ids.view(-1)])
    assert torch.equal(embed(w, ids), models["float32"].weights.wte[ids])
    many = torch.arange(100)  # past a decode step: through the mapping, pages released after
    assert torch.equal(embed(w, many), models["float32"].weights.wte[many])
    with pytest.raises(IndexError, match="index 50257 is out of bounds for 50257 rows"):
        embed(w, torch.tensor([50257]))
    other = replace(w.wte_pages, inode=(0, 0))  # as if the file on disk were replaced since it was mapped
    assert other.read_rows(w.wte, [464]) is None


@pytest.mark.parametrize("name", list(VARIANTS))
def test_a_passs_embedding_in_one_native_call_is_models(models: dict[str, GPT2], name: str) -> None:
    """rows.native_embed (what a pass's rows start from unsteered): the bits of model.embed + wpe in every format
    (bfloat16's wte widened, a quantized model's rows read from the file, past FEW_IDS rows left to model.embed);
    an id or a position out of range is named."""
    w, cfg = models[name].weights, models[name].config
    assert embeds_natively(w) and native_rows(w, cfg).embeds
    ids, positions = [464, 0, cfg.vocab_size - 1, 13], [0, 7, cfg.n_positions - 1, 7]
    got = native_embed(w, ids, positions)  # [1, 4, C]
    expected = embed(w, torch.tensor(ids)) + w.wpe[torch.tensor(positions)]  # [4, C]
    assert got is not None and got.shape == (1, 4, cfg.n_embd) and torch.equal(got[0], expected)
    many = native_embed(w, list(range(FEW_IDS + 1)), list(range(FEW_IDS + 1)))
    assert (many is None) == (w.wte_pages is not None)
    native = decode_kernels()
    with pytest.raises(RuntimeError, match=f"token id {cfg.vocab_size} is out of range for {cfg.vocab_size} rows"):
        native.embed_rows(w.wte, [cfg.vocab_size], w.wpe, [0])
    with pytest.raises(RuntimeError, match=f"position -1 is out of range for {cfg.n_positions} positions"):
        native.embed_rows(w.wte, [1], w.wpe, [-1])
    with pytest.raises(RuntimeError, match="expected as many positions as ids"):
        native.embed_rows(w.wte, [1, 2], w.wpe, [0])
