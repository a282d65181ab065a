"""The loader: name table, strict accounting, the Q/K/V split, one error type with a one-line message."""

from __future__ import annotations

import json
import mmap
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import assert_same_weights, edited_copy

from gpt2_engine import GPT2, GPT2Config, WeightsError
from gpt2_engine.core.config import preset
from gpt2_engine.core.model import linear, merge_heads, split_heads
from gpt2_engine.core.weights import expected_shapes, parameter_count, split_qkv
from gpt2_engine.formats.hf import load_weights


def variant(tiny_dir: Path, dest: Path, edit: Callable[[dict[str, torch.Tensor]], None] | None = None) -> Path:
    """A copy of the tiny fixture (safetensors only) with its tensors edited in place by `edit`."""
    return edited_copy(tiny_dir, dest, edit)


def load_error(directory: Path) -> str:
    with pytest.raises(WeightsError) as e:
        GPT2.from_pretrained(directory)
    message = str(e.value)
    assert "\n" not in message
    return message


# --- the Q/K/V split -------------------------------------------------------------------------------------------


def test_split_qkv_takes_q_k_v_columns_in_order() -> None:
    C = 6
    w = torch.arange(C * 3 * C, dtype=torch.float32).view(C, 3 * C)  # Conv1D (in, out)
    q, k, v = split_qkv(w)
    assert torch.equal(q, w[:, 0:C]) and torch.equal(k, w[:, C : 2 * C]) and torch.equal(v, w[:, 2 * C :])
    assert torch.equal(torch.cat([q, k, v], dim=-1), w)  # round trip
    bq, bk, bv = split_qkv(torch.arange(3 * C))
    assert bq.tolist() == [0, 1, 2, 3, 4, 5] and bk.tolist() == [6, 7, 8, 9, 10, 11] and bv[0] == 12


def test_splitting_the_weights_equals_splitting_the_projection(tiny_model: GPT2) -> None:
    blk = tiny_model.weights.blocks[0]
    x = torch.randn(2, 5, tiny_model.config.n_embd)
    fused = split_qkv(linear(x, blk.c_attn))
    for part, proj in zip(fused, blk.qkv()):
        assert torch.allclose(part, linear(x, proj), atol=1e-6)
    # heads: head h of Q holds the channels [h*hs, (h+1)*hs) of Q
    q = fused[0]
    heads = split_heads(q, tiny_model.config.n_head)  # [B, nh, T, hs]
    hs = tiny_model.config.head_size
    assert torch.equal(heads[:, 2], q[..., 2 * hs : 3 * hs])
    assert torch.equal(merge_heads(heads), q)


def test_split_qkv_rejects_a_width_not_divisible_by_three() -> None:
    with pytest.raises(ValueError, match="3\\*C"):
        split_qkv(torch.zeros(4, 10))


# --- config and name table -------------------------------------------------------------------------------------


def test_presets_have_the_official_parameter_counts() -> None:
    counts = {name: parameter_count(preset(name)) for name in ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")}
    assert counts == {"gpt2": 124439808, "gpt2-medium": 354823168, "gpt2-large": 774030080, "gpt2-xl": 1557611200}


def test_name_table_has_the_official_names() -> None:
    names = expected_shapes(GPT2Config())
    assert len(names) == 148  # the official file's 160 tensors less the 12 h.N.attn.bias buffers
    assert names["h.11.attn.c_attn.weight"] == (768, 2304) and names["h.0.mlp.c_proj.weight"] == (3072, 768)


def test_config_rejects_options_that_change_the_math(tmp_path: Path, tiny_dir: Path) -> None:
    cfg = json.loads((tiny_dir / "config.json").read_text())
    cfg["activation_function"] = "relu"  # "gelu" (the exact erf form, nanoGPT's) and "gelu_new" are read
    d = variant(tiny_dir, tmp_path / "c")
    (d / "config.json").write_text(json.dumps(cfg))
    assert "activation_function 'relu' is not supported (expected 'gelu_new' or 'gelu')" in load_error(d)
    cfg["activation_function"], cfg["scale_attn_weights"] = "gelu", False
    (d / "config.json").write_text(json.dumps(cfg))
    assert "scale_attn_weights=False is not supported (expected True)" in load_error(d)


def test_config_rejects_heads_that_do_not_divide_channels(tmp_path: Path, tiny_dir: Path) -> None:
    d = variant(tiny_dir, tmp_path / "c")
    cfg = json.loads((d / "config.json").read_text()) | {"n_head": 5}
    (d / "config.json").write_text(json.dumps(cfg))
    assert "n_embd (64) must be divisible by n_head (5)" in load_error(d)


def test_missing_config_json(tmp_path: Path, tiny_dir: Path) -> None:
    d = variant(tiny_dir, tmp_path / "c")
    (d / "config.json").unlink()
    assert "config.json not found" in load_error(d)


# --- accepted variations ---------------------------------------------------------------------------------------


def test_transformer_prefix_and_equal_lm_head_are_accepted(tmp_path: Path, tiny_dir: Path, tiny_model: GPT2) -> None:
    def prefixed(t: dict[str, torch.Tensor]) -> None:
        for name in list(t):
            t["transformer." + name] = t.pop(name)
        t["lm_head.weight"] = t["transformer.wte.weight"].clone()

    assert_same_weights(GPT2.from_pretrained(variant(tiny_dir, tmp_path / "p", prefixed)).weights, tiny_model.weights)


def test_float32_weights_are_used_in_place_not_copied(tiny_dir: Path) -> None:
    """Each float32 parameter's memory lies inside a memory mapping of model.safetensors (Linux /proc)."""
    w = load_weights(tiny_dir, GPT2Config.from_json(tiny_dir / "config.json"))
    target = str((tiny_dir / "model.safetensors").resolve())
    maps = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        if line.endswith(target):
            lo, hi = (int(a, 16) for a in line.split()[0].split("-"))
            maps.append((lo, hi))
    for t in (w.wte, w.wpe, w.blocks[1].c_fc.weight, w.ln_f.bias):
        assert any(lo <= t.data_ptr() < hi for lo, hi in maps), "a parameter was copied out of the mapped file"


# --- errors ----------------------------------------------------------------------------------------------------


def test_missing_tensor(tmp_path: Path, tiny_dir: Path) -> None:
    d = variant(tiny_dir, tmp_path / "m", lambda t: t.pop("h.1.mlp.c_fc.bias"))
    msg = load_error(d)
    assert "model.safetensors: missing tensor h.1.mlp.c_fc.bias (expected shape [256])" in msg


def test_wrong_shape(tmp_path: Path, tiny_dir: Path) -> None:
    def transpose(t: dict[str, torch.Tensor]) -> None:
        t["h.0.attn.c_attn.weight"] = t["h.0.attn.c_attn.weight"].t().contiguous()

    msg = load_error(variant(tiny_dir, tmp_path / "s", transpose))
    assert "tensor h.0.attn.c_attn.weight has shape [192, 64], expected [64, 192]" in msg


def test_non_float_dtype(tmp_path: Path, tiny_dir: Path) -> None:
    def to_int(t: dict[str, torch.Tensor]) -> None:
        t["ln_f.bias"] = t["ln_f.bias"].to(torch.int32)

    assert "tensor ln_f.bias has dtype int32, expected one of float32, float16, bfloat16, float64" in load_error(
        variant(tiny_dir, tmp_path / "d", to_int)
    )


def test_nan_in_a_tensor(tmp_path: Path, tiny_dir: Path) -> None:
    def poison(t: dict[str, torch.Tensor]) -> None:
        t["h.1.ln_2.weight"][3] = float("nan")

    assert "tensor h.1.ln_2.weight holds 1 NaN/Inf values, expected finite weights" in load_error(
        variant(tiny_dir, tmp_path / "n", poison)
    )


def test_unexpected_tensor(tmp_path: Path, tiny_dir: Path) -> None:
    def extra(t: dict[str, torch.Tensor]) -> None:
        t["h.2.ln_1.weight"] = torch.ones(64)

    assert "unexpected tensor h.2.ln_1.weight (not part of GPT-2 with n_layer=2)" in load_error(
        variant(tiny_dir, tmp_path / "u", extra)
    )


def test_untied_lm_head(tmp_path: Path, tiny_dir: Path) -> None:
    def untie(t: dict[str, torch.Tensor]) -> None:
        t["lm_head.weight"] = t["wte.weight"] + 1.0

    assert "lm_head.weight differs from wte.weight (max |diff| 1)" in load_error(variant(tiny_dir, tmp_path / "l", untie))


def test_truncated_safetensors(tmp_path: Path, tiny_dir: Path) -> None:
    d = variant(tiny_dir, tmp_path / "t")
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    assert "model.safetensors: not a readable safetensors file" in load_error(d)


def test_corrupt_safetensors_header(tmp_path: Path, tiny_dir: Path) -> None:
    d = variant(tiny_dir, tmp_path / "h")
    (d / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all" + b"\0" * 64)
    assert "model.safetensors: not a readable safetensors file" in load_error(d)


def test_truncated_pytorch_bin(tmp_path: Path, tiny_dir: Path) -> None:
    d = variant(tiny_dir, tmp_path / "b")
    (d / "model.safetensors").unlink()
    data = (tiny_dir / "pytorch_model.bin").read_bytes()
    (d / "pytorch_model.bin").write_bytes(data[: len(data) - 1000])
    assert "pytorch_model.bin: not a readable PyTorch checkpoint" in load_error(d)


def test_pytorch_bin_is_read_when_there_is_no_safetensors(tmp_path: Path, tiny_dir: Path, tiny_model: GPT2) -> None:
    d = variant(tiny_dir, tmp_path / "b")
    (d / "model.safetensors").unlink()
    shutil.copyfile(tiny_dir / "pytorch_model.bin", d / "pytorch_model.bin")
    assert_same_weights(GPT2.from_pretrained(d).weights, tiny_model.weights)


def test_directory_without_weights(tmp_path: Path, tiny_dir: Path) -> None:
    d = variant(tiny_dir, tmp_path / "w")
    (d / "model.safetensors").unlink()
    assert "no model.safetensors or pytorch_model.bin found (run `make weights`" in load_error(d)


def test_unknown_format(tmp_path: Path, tiny_dir: Path) -> None:
    d = variant(tiny_dir, tmp_path / "f")
    (d / "model.safetensors").rename(d / "tf_model.h5")
    assert "unsupported weights format tf_model.h5; expected model.safetensors or pytorch_model.bin" in load_error(d)


def test_directory_that_does_not_exist(tmp_path: Path) -> None:
    assert "weights directory does not exist" in load_error(tmp_path / "nowhere")


def test_a_file_instead_of_a_directory(tiny_dir: Path) -> None:
    assert "expected a directory holding config.json" in load_error(tiny_dir / "model.safetensors")


def _resident_kb() -> int:
    return next(int(line.split()[1]) for line in Path("/proc/self/status").read_text().splitlines()
                if line.startswith("VmRSS:"))


@pytest.mark.skipif(not Path("/proc/self/status").exists(),
                    reason="resident memory is read from /proc/self/status, which only Linux has")
def test_released_pages_come_back_with_the_same_values(small_dir: Path) -> None:
    """release_pages drops the resident pages of a tensor mapped from the checkpoint file (the RSS falls by about
    its size) and a later read gets the file's bytes back; a tensor not mapped from the file is left alone."""
    from gpt2_engine.formats.hf import find_weights_file
    from gpt2_engine.core.pages import release_pages

    config = GPT2Config.from_json(small_dir / "config.json")
    path = find_weights_file(small_dir)
    kept = load_weights(small_dir, config)
    copy = kept.wte.clone()  # [V, C] float32, 154 MB: anonymous memory, not the file's
    before = _resident_kb()
    assert release_pages(kept.wte, path)
    assert before - _resident_kb() > 100_000  # most of wte's 150,000 KiB left
    assert torch.equal(kept.wte, copy)  # read back from the file
    assert not release_pages(copy, path) and torch.equal(copy, kept.wte)
    released = load_weights(small_dir, config, resident=False)
    assert torch.equal(released.blocks[3].c_fc.weight, kept.blocks[3].c_fc.weight)


def _present_pages(start: int, end: int) -> int:
    """How many pages of [start, end) this process has mapped (bit 63 of each /proc/self/pagemap entry)."""
    first, last = start // mmap.PAGESIZE, -(-end // mmap.PAGESIZE)
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        entries = struct.unpack(f"{last - first}Q", f.read((last - first) * 8))
    return sum(e >> 63 for e in entries)


@pytest.mark.skipif(not Path("/proc/self/pagemap").exists(),
                    reason="resident pages are counted through /proc/self/pagemap, which only Linux has")
@pytest.mark.slow
def test_a_quantized_model_keeps_no_float32_embedding_pages(small_dir: Path) -> None:
    """A quantized model reads wte only for the embedding; each lookup maps the page-cache folios around its rows
    (about 0.9 MB each on a kernel with large folios), and embed() drops them again, with the file's values."""
    from gpt2_engine.core.ops import embed

    model = GPT2.from_pretrained(small_dir, quantize="int8")
    pages = model.weights.wte_pages
    assert pages is not None and (pages.start, pages.end) == (model.weights.wte.data_ptr(), pages.start + 50257 * 768 * 4)
    ids = torch.arange(0, 50257, 1000)  # [51] rows spread over all of wte
    rows = embed(model.weights, ids)  # [51, C]
    assert _present_pages(pages.start, pages.end) == 0
    fp32 = load_weights(small_dir, GPT2Config.from_json(small_dir / "config.json"))
    assert torch.equal(rows, fp32.wte[ids])
    assert _present_pages(pages.start, pages.end) == 0  # reading fp32's own mapping leaves the quantized one alone
    assert model.weights.wte[ids].sum() != 0 and _present_pages(pages.start, pages.end) > 0  # a plain read maps pages
    assert not pages.release(fp32.wte) and not pages.release(rows)  # tensors outside the range are left alone
    assert pages.release(model.weights.wte[1000:2000]) and pages.release(model.weights.wte)
    assert _present_pages(pages.start, pages.end) == 0
