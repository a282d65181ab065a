"""core/pages.py: the decode step's matrices on 2 MB pages, with the same values, offsets and bits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import gpt2_engine.api as api
import gpt2_engine.core.pages as pages
from gpt2_engine import GPT2
from gpt2_engine.core.config import GPT2Config
from gpt2_engine.core.model import KVCache
from gpt2_engine.core.pages import HUGE_PAGE, HugeArena, huge_pages_available, huge_zeros, move_to_huge_pages
from gpt2_engine.core.weights import PanelMatrix, QuantizedMatrix
from gpt2_engine.core.pages import file_pages
from gpt2_engine.formats.hf import find_weights_file

THP = huge_pages_available()


def anon_huge_kb(ptr: int) -> int:
    """AnonHugePages (KiB) of the mapping holding address `ptr`, from /proc/self/smaps."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    inside = False
    for line in lines:
        head = line.split(maxsplit=1)[0]
        if "-" in head and not head.endswith(":"):
            low, high = (int(a, 16) for a in head.split("-"))
            inside = low <= ptr < high
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {ptr:#x}")


def test_huge_pages_available_reads_the_kernels_mode(tmp_path: Path) -> None:
    mode = tmp_path / "enabled"
    for text, expected in (("always [madvise] never\n", True), ("[always] madvise never\n", True),
                           ("always madvise [never]\n", False)):
        mode.write_text(text)
        assert huge_pages_available(mode) is expected, text
    assert huge_pages_available(tmp_path / "missing") is False


def test_an_arena_hands_out_line_aligned_pieces_on_huge_pages() -> None:
    """HugeArena: the loader writes panels straight into it; pieces start on 64-byte lines, one after another, and
    asking past its size is an error, not an overlap."""
    arena = HugeArena(3 * 4096 + 100)
    a = arena.take((10, 3), torch.float32)  # 120 bytes: the next piece starts at 128
    b = arena.take((3, 1024), torch.bfloat16)
    assert a.data_ptr() % HUGE_PAGE == 0 and b.data_ptr() == a.data_ptr() + 128 and arena.holds(a)
    assert b.shape == (3, 1024) and b.dtype == torch.bfloat16 and not arena.holds(torch.empty(3))
    b.fill_(1.5)
    assert float(b.float().sum()) == 1.5 * 3 * 1024
    if THP:
        assert anon_huge_kb(b.data_ptr()) >= HUGE_PAGE // 1024
    with pytest.raises(MemoryError, match="HugeArena: 8192 bytes asked with"):
        arena.take((2048,), torch.float32)


def test_the_kv_cache_is_zeros_on_huge_pages_where_it_fills_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """huge_zeros: at least 2 MB on the CPU on a mapping advised as huge pages (zeros until written); less than that,
    another device, or no transparent huge pages: torch.zeros. KVCache.allocate takes it for both halves of a cache."""
    big = huge_zeros((2, 3, 1024, 128))  # 3 MB
    assert big.shape == (2, 3, 1024, 128) and big.dtype == torch.float32 and big.is_contiguous()
    assert not big.any()
    big[1, 2, 1023, 127] = 2.5  # the last element: the mapping covers the whole tensor
    assert float(big.sum()) == 2.5
    if THP:
        assert big.data_ptr() % HUGE_PAGE == 0 and anon_huge_kb(big.data_ptr()) >= HUGE_PAGE // 1024
    cache = KVCache.allocate(GPT2Config(), 2, 64)  # 12 x 2 x 12 x 64 x 64 floats, 4.5 MB each
    assert cache.k.shape == cache.v.shape == (12, 2, 12, 64, 64) and not cache.k.any() and not cache.v.any()
    if THP:
        assert cache.k.data_ptr() % HUGE_PAGE == 0 and cache.v.data_ptr() % HUGE_PAGE == 0

    def no_mapping(nbytes: int) -> torch.Tensor:
        raise AssertionError(f"a huge-page mapping for {nbytes} bytes")

    monkeypatch.setattr(pages, "huge_region", no_mapping)  # below 2 MB: torch.zeros
    small = huge_zeros((4, 1000), torch.bfloat16)
    assert small.shape == (4, 1000) and small.dtype == torch.bfloat16 and not small.any()
    assert huge_zeros((2, 3, 1024, 128), device="meta").device.type == "meta"  # another device: torch.zeros there
    monkeypatch.setattr(pages, "huge_pages_available", lambda: False)  # no transparent huge pages: torch.zeros
    assert not huge_zeros((2, 3, 1024, 128)).any()


def test_moved_tensors_keep_values_shapes_and_offsets_within_a_line() -> None:
    """Each tensor moves to its old offset within a 64-byte line (the kernels' alignment paths stay the same), all
    into one mapping whose first line starts on a 2 MB boundary; a view taken before the move keeps the old memory."""
    raw = torch.arange(4096, dtype=torch.float32)
    tensors = [raw[1:1 + 24 * 32].view(24, 32), torch.arange(7, dtype=torch.int8) * 3,  # 4-byte and 1-byte offsets
               torch.randn(300, 5).to(torch.bfloat16), raw[16:2064]]
    before = [(t.clone(), t.data_ptr(), t.shape) for t in tensors]
    kept = tensors[2][:10]  # a view of the old storage
    move_to_huge_pages(tensors)
    storage = tensors[0].untyped_storage().data_ptr()
    for t, (values, ptr, shape) in zip(tensors, before):
        assert t.shape == shape and t.dtype == values.dtype and torch.equal(t, values)
        assert t.data_ptr() != ptr and t.data_ptr() % 64 == ptr % 64
        assert t.untyped_storage().data_ptr() == storage
    assert tensors[0].data_ptr() // 64 * 64 % HUGE_PAGE == 0
    ends = [t.data_ptr() + t.numel() * t.element_size() for t in tensors]
    assert all(end <= nxt.data_ptr() for end, nxt in zip(ends, tensors[1:]))  # no overlap, in order
    assert torch.equal(kept, before[2][0][:10]) and kept.data_ptr() == before[2][1]


@pytest.mark.skipif(not THP, reason="transparent huge pages are off here (mode never in /sys/kernel/mm/transparent_hugepage/enabled, or not Linux): the engine moves nothing, so there is nothing to check")
def test_the_moved_tensors_lie_on_huge_pages() -> None:
    t = torch.randn(3 * HUGE_PAGE // 4)  # 6 MB: at least two whole huge pages
    move_to_huge_pages([t])
    assert anon_huge_kb(t.data_ptr()) >= 2 * HUGE_PAGE // 1024


@pytest.mark.parametrize("kwargs", [{"dtype": "bfloat16"}, {"quantize": "int8"}, {"quantize": "int4"}],
                         ids=["bfloat16", "int8", "int4"])
def test_a_loaded_model_streams_its_matrices_from_one_region_with_the_same_bits(
        tiny_dir: Path, kwargs: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """from_pretrained moves a converted or quantized model's block matrices and head into one mapping (panels are
    written into one of their own); its logits and greedy tokens are those of the same weights left where loading
    put them."""
    kwargs = {**kwargs, "weight_layout": "plain"}  # packed units are placed by packing.pack_weights (test_packed)
    placed = GPT2.from_pretrained(tiny_dir, **kwargs)
    monkeypatch.setattr(api, "matrices_on_huge_pages", lambda w, *_, **__: w)
    monkeypatch.setattr(api, "huge_pages_available", lambda: False)  # and no arena for the panels
    plain = GPT2.from_pretrained(tiny_dir, **kwargs)

    def parts(w) -> list[torch.Tensor]:
        ms = [getattr(b, n).weight for b in w.blocks for n in ("c_attn", "attn_c_proj", "c_fc", "mlp_c_proj")]
        ms.append(w.head)
        return [t for m in ms for t in ((m.packed, m.scales) if isinstance(m, QuantizedMatrix)
                                        else (m.panels,) if isinstance(m, PanelMatrix) else (m,))]

    storages = {t.untyped_storage().data_ptr() for t in parts(placed.weights)}
    if THP:  # the panels' arena, where the loader keeps panels (on AMD's cores), and the mapping the rest moved to
        paneled = any(isinstance(b.mlp_c_proj.weight, PanelMatrix) for b in placed.weights.blocks)
        assert len(storages) == 1 + paneled
        assert len({t.untyped_storage().data_ptr() for t in parts(plain.weights)}) > 1
    for a, b in zip(parts(placed.weights), parts(plain.weights)):
        assert torch.equal(a, b) and a.data_ptr() % 64 == b.data_ptr() % 64
    if "dtype" in kwargs:  # the tied head is the embedding too: one copy
        assert placed.weights.wte is placed.weights.head
    ids = torch.tensor([[464, 2068, 7586, 21831, 11687, 625, 262]])
    assert torch.equal(placed(ids), plain(ids))
    prompt = [464, 2068, 7586]
    assert placed.generate_ids(prompt, max_new_tokens=12, temperature=0) == \
        plain.generate_ids(prompt, max_new_tokens=12, temperature=0)


@pytest.mark.parametrize("vendor", ["GenuineIntel", "AuthenticAMD"])
def test_float32_weights_are_read_in_place_from_the_checkpoint_file(tiny_dir: Path, vendor: str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Float32 matrices are used in place from the mapped file (core/pages.py says why). Where the projections are
    kept in panels (an AMD CPU), the panels and the head are the process's own, the head on huge pages and read as
    wte too; the plain matrices stay in the file for GEMMs."""
    import dataclasses

    from gpt2_engine.core.kernels import cpu

    monkeypatch.setattr(api, "cpu", lambda: dataclasses.replace(cpu(), vendor=vendor))
    model = GPT2.from_pretrained(tiny_dir, weight_layout="plain")  # the packed layout's: tests/test_packed.py
    path = find_weights_file(tiny_dir)
    w = model.weights
    down = w.blocks[1].mlp_c_proj.weight  # (4C, C): a shape that fits panels here
    if not api.cpu().panels:
        assert file_pages(w.head, path) is not None and file_pages(down, path) is not None
        return
    assert isinstance(down, PanelMatrix) and file_pages(down.plain, path) is not None
    assert file_pages(down.panels, path) is None and w.wte is w.head
    if THP:  # the panels written in place into one arena, the head moved beside it
        assert len({getattr(b, f).weight.panels.untyped_storage().data_ptr() for b in w.blocks
                    for f in ("c_attn", "attn_c_proj", "c_fc", "mlp_c_proj")
                    if isinstance(getattr(b, f).weight, PanelMatrix)}) == 1
        assert anon_huge_kb(down.panels.data_ptr()) >= HUGE_PAGE // 1024
        assert file_pages(w.head, path) is None and anon_huge_kb(w.head.data_ptr()) >= 2 * HUGE_PAGE // 1024
