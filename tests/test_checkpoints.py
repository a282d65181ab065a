"""Checkpoints of other trainers: nanoGPT's ckpt.pt and llm.c's model file, read by content (GPT2.from_pretrained,
--weights) and written (gpt2 convert --to hf|llmc).

nanoGPT's side is a reimplementation of its model.py's GPT from its file format (nn.Linear layouts, nn.GELU()'s exact
erf form, LayerNorm with or without bias, the tied head, the vocabulary padded to 50,304), trained a few steps and
saved as its train.py saves; llm.c's side is its train_gpt2.py write_model's layout, checked field by field. (Against
nanoGPT's and llm.c's own code, fetched: the engine's logits equal nanoGPT's forward to the bit, and engine -> llm.c
files are byte-identical to write_model's, float32 and bfloat16; see the session note.)
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import cli

from gpt2_engine import GPT2, WeightsError
from gpt2_engine.formats.llmc import LLMC_MAGIC, read_llmc, write_llmc
from gpt2_engine.core.weights import named_tensors

VOCAB, PADDED = 50257, 50304


class NanoBlock(nn.Module):
    def __init__(self, C: int, nh: int, bias: bool) -> None:
        super().__init__()
        self.nh = nh
        self.ln_1 = nn.LayerNorm(C, bias=bias)
        self.attn = nn.Module()
        self.attn.c_attn = nn.Linear(C, 3 * C, bias=bias)
        self.attn.c_proj = nn.Linear(C, C, bias=bias)
        self.ln_2 = nn.LayerNorm(C, bias=bias)
        self.mlp = nn.Module()
        self.mlp.c_fc = nn.Linear(C, 4 * C, bias=bias)
        self.mlp.c_proj = nn.Linear(4 * C, C, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.attn.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.nh, C // self.nh).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        x = x + self.attn.c_proj(y)
        return x + self.mlp.c_proj(F.gelu(self.mlp.c_fc(self.ln_2(x))))  # nn.GELU(): the exact erf form


class NanoGPT(nn.Module):
    """nanoGPT's model.py GPT, as its state_dict and forward are laid out."""

    def __init__(self, n_layer: int, n_head: int, n_embd: int, block_size: int, bias: bool) -> None:
        super().__init__()
        self.transformer = nn.Module()
        self.transformer.wte = nn.Embedding(PADDED, n_embd)
        self.transformer.wpe = nn.Embedding(block_size, n_embd)
        self.transformer.h = nn.ModuleList(NanoBlock(n_embd, n_head, bias) for _ in range(n_layer))
        self.transformer.ln_f = nn.LayerNorm(n_embd, bias=bias)
        self.lm_head = nn.Linear(n_embd, PADDED, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # tied
        torch.manual_seed(0)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = self.transformer
        x = t.wte(ids) + t.wpe(torch.arange(ids.shape[1]))
        for blk in t.h:
            x = blk(x)
        return self.lm_head(t.ln_f(x))


def nanogpt_checkpoint(path: Path, bias: bool = True, compiled: bool = False, steps: int = 3) -> NanoGPT:
    """A NanoGPT trained `steps` AdamW steps, saved as nanoGPT's train.py saves ckpt.pt."""
    args = dict(n_layer=2, n_head=4, n_embd=64, block_size=64, bias=bias, vocab_size=PADDED, dropout=0.0)
    model = NanoGPT(2, 4, 64, 64, bias)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, VOCAB, (4, 33), generator=torch.Generator().manual_seed(2))
    for _ in range(steps):
        loss = F.cross_entropy(model(ids[:, :-1]).reshape(-1, PADDED), ids[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
    state = model.state_dict()
    if compiled:  # torch.compile's wrapper prefixes every key
        state = {f"_orig_mod.{k}": v for k, v in state.items()}
    torch.save({"model": state, "optimizer": opt.state_dict(), "model_args": args, "iter_num": steps,
                "best_val_loss": loss.item(), "config": {"dataset": "docstrings", "batch_size": 4}}, path)
    return model.eval()


IDS = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("bias,compiled", [(True, False), (False, False), (True, True)])
def test_a_nanogpt_checkpoint_gives_nanogpts_logits(tmp_path: Path, bias: bool, compiled: bool) -> None:
    ref = nanogpt_checkpoint(tmp_path / "ckpt.pt", bias, compiled)
    with torch.no_grad():
        want = ref(IDS)[..., :VOCAB]  # the padding rows are never a token
    model = GPT2.from_pretrained(tmp_path / "ckpt.pt")
    assert model.config.activation_function == "gelu" and model.config.vocab_size == VOCAB
    got = model(IDS)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    # GPT-2's tanh GELU would not be nanoGPT's function: the erf form is what makes the logits agree
    from dataclasses import replace

    from gpt2_engine.core.model import forward
    with torch.no_grad():
        tanh = forward(model.weights, replace(model.config, activation_function="gelu_new"), IDS)
    assert (tanh - want).abs().max() > 10 * (got - want).abs().max()
    # and it generates: every decode path (native rows are GPT-2's tanh form, so these run in torch)
    ids = IDS[0, :8].tolist()
    out = model.generate_ids(ids, max_new_tokens=6, temperature=0)
    seq = list(ids)
    with torch.no_grad():
        for _ in range(6):
            seq.append(int(ref(torch.tensor([seq]))[0, -1, :VOCAB].argmax()))
    assert out == seq[8:]


def test_nanogpt_files_that_are_not_gpt2_are_refused_by_name(tmp_path: Path) -> None:
    nanogpt_checkpoint(tmp_path / "ok.pt", steps=1)
    ckpt = torch.load(tmp_path / "ok.pt", weights_only=True)
    char = dict(ckpt, model_args={**ckpt["model_args"], "vocab_size": 65})
    torch.save(char, tmp_path / "char.pt")
    (tmp_path / "meta.pkl").write_bytes(b"not read")
    with pytest.raises(WeightsError, match=r"a vocabulary of 65 tokens \(with .*meta.pkl\) is a character-level model"):
        GPT2.from_pretrained(tmp_path / "char.pt")
    extra = dict(ckpt, model={**ckpt["model"], "transformer.h.0.mlp.gate.weight": torch.zeros(2)})
    torch.save(extra, tmp_path / "extra.pt")
    with pytest.raises(WeightsError, match="unexpected tensor transformer.h.0.mlp.gate.weight"):
        GPT2.from_pretrained(tmp_path / "extra.pt")
    missing = dict(ckpt, model={k: v for k, v in ckpt["model"].items() if "h.1.ln_2" not in k})
    torch.save(missing, tmp_path / "missing.pt")
    with pytest.raises(WeightsError, match="missing tensor transformer.h.1.ln_2.weight"):
        GPT2.from_pretrained(tmp_path / "missing.pt")

    class Evil:
        def __reduce__(self):
            return (print, ("ran code",))

    torch.save(dict(ckpt, config=Evil()), tmp_path / "evil.pt")
    with pytest.raises(WeightsError, match="not a readable nanoGPT checkpoint"):
        GPT2.from_pretrained(tmp_path / "evil.pt")
    (tmp_path / "junk.bin").write_bytes(b"\x00" * 64)
    with pytest.raises(WeightsError, match="not a checkpoint the engine reads"):
        GPT2.from_pretrained(tmp_path / "junk.bin")


def test_llmc_files_round_trip_and_follow_write_models_layout(trained_dir: Path, trained_model: GPT2,
                                                              tmp_path: Path) -> None:
    c = trained_model.config
    named = named_tensors(trained_model.weights)
    write_llmc(tmp_path / "a.bin", c, named)
    header = np.fromfile(tmp_path / "a.bin", dtype="<i4", count=256)
    padded = math.ceil(VOCAB / 128) * 128
    assert header[:8].tolist() == [LLMC_MAGIC, 3, c.n_positions, VOCAB, c.n_layer, c.n_head, c.n_embd, padded]
    assert not header[8:].any()
    C, L = c.n_embd, c.n_layer
    params = padded * C + c.n_positions * C + L * (12 * C * C + 13 * C) + 2 * C
    assert (tmp_path / "a.bin").stat().st_size == 1024 + 4 * params
    body = np.fromfile(tmp_path / "a.bin", dtype="<f4", offset=1024)
    assert np.array_equal(body[: VOCAB * C], named["wte.weight"].numpy().ravel())  # wte first, row-major
    assert not body[VOCAB * C : padded * C].any()  # the padding rows are zeros
    start = padded * C + c.n_positions * C + 2 * L * C  # after wte, wpe, every ln_1 weight and bias
    first_qkv = body[start : start + 3 * C * C].reshape(3 * C, C)  # layer 0's c_attn as nn.Linear's (3C, C)
    assert np.array_equal(first_qkv, named["h.0.attn.c_attn.weight"].t().numpy())

    back = GPT2.from_pretrained(tmp_path / "a.bin")
    assert torch.equal(back(IDS), trained_model(IDS))  # logits to the bit: the same float32 weights
    write_llmc(tmp_path / "b.bin", back.config, named_tensors(back.weights))
    assert (tmp_path / "a.bin").read_bytes() == (tmp_path / "b.bin").read_bytes()  # engine -> llm.c -> engine

    write_llmc(tmp_path / "bf16.bin", c, named, "bfloat16")
    assert np.fromfile(tmp_path / "bf16.bin", dtype="<i4", count=2)[1] == 5
    _, tensors = read_llmc(tmp_path / "bf16.bin")
    assert torch.equal(tensors["h.1.mlp.c_fc.weight"], named["h.1.mlp.c_fc.weight"].bfloat16().float())

    data = (tmp_path / "a.bin").read_bytes()
    (tmp_path / "short.bin").write_bytes(data[:-8])
    with pytest.raises(WeightsError, match="expected .* for an llm.c model with 4 layers, 256 channels \\(truncated\\)"):
        GPT2.from_pretrained(tmp_path / "short.bin")
    bad = bytearray(data)
    bad[4:8] = (4).to_bytes(4, "little")
    (tmp_path / "v4.bin").write_bytes(bytes(bad))
    with pytest.raises(WeightsError, match="llm.c model version 4 is not read"):
        GPT2.from_pretrained(tmp_path / "v4.bin")


def test_gpt2_convert_between_formats(trained_dir: Path, trained_model: GPT2, tmp_path: Path) -> None:
    nanogpt_checkpoint(tmp_path / "ckpt.pt", bias=False)
    assert cli("convert", str(tmp_path / "ckpt.pt"), str(tmp_path / "hf"), "--to", "hf")[0] == 0
    transformers = pytest.importorskip("transformers")
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    nano = GPT2.from_pretrained(tmp_path / "ckpt.pt")
    with torch.no_grad():
        assert (hf(IDS).logits - nano(IDS)).abs().max() <= 1e-5 * nano(IDS).abs().max()  # transformers runs it too
    assert hf.config.activation_function == "gelu"
    code, err = cli("convert", str(tmp_path / "ckpt.pt"), str(tmp_path / "nano.bin"), "--to", "llmc")
    assert code == 2 and "llm.c computes GPT-2's tanh GELU" in err and err.count("\n") == 1

    assert cli("convert", str(trained_dir), str(tmp_path / "m.bin"), "--to", "llmc")[0] == 0
    assert cli("convert", str(tmp_path / "m.bin"), str(tmp_path / "again"), "--to", "hf")[0] == 0
    again = GPT2.from_pretrained(tmp_path / "again")
    assert torch.equal(again(IDS), trained_model(IDS))
    assert cli("convert", str(trained_dir), str(tmp_path / "m16.bin"), "--to", "llmc", "--type", "bf16")[0] == 0
    assert np.fromfile(tmp_path / "m16.bin", dtype="<i4", count=2)[1] == 5
    code, err = cli("convert", str(trained_dir), str(tmp_path / "x"), "--to", "hf", "--type", "bf16")
    assert code == 2 and "a hf checkpoint is written as f32" in err
    code, err = cli("convert", str(tmp_path / "nowhere"), str(tmp_path / "y"), "--to", "hf")
    assert code == 2 and "no such checkpoint" in err

    # a model already at the destination is replaced only with --overwrite (a typo must not cost a checkpoint)
    (tmp_path / "again" / "pytorch_model.bin").write_bytes(b"an older model")  # replaced with the folder's model
    for to, dst in (("hf", tmp_path / "again"), ("llmc", tmp_path / "m.bin")):
        code, err = cli("convert", str(trained_dir), str(dst), "--to", to)
        held = ("already holds a model (config.json, model.safetensors, pytorch_model.bin)" if to == "hf"
                else "already exists")
        assert (code, err) == (2, f"gpt2 convert: error: {dst}: {held}; pass --overwrite to replace it"
                                  f"{', or write somewhere else' if to == 'hf' else ''}\n")
        assert cli("convert", str(trained_dir), str(dst), "--to", to, "--overwrite")[0] == 0
    assert sorted(p.name for p in (tmp_path / "again").iterdir()) == [
        "config.json", "generation_config.json", "merges.txt", "model.safetensors", "vocab.json"]

    code, err = cli("generate", "Return the", "-n", "4", "--temperature", "0", "--weights", str(tmp_path / "m.bin"))
    assert code == 0


def test_the_erf_gelus_backward_is_autograds(tmp_path: Path) -> None:
    """Training a nanoGPT model runs the exact GELU's derivative, Phi(x) + x phi(x), as autograd has it."""
    from gpt2_engine.train.backward import gelu_backward, gelu_forward

    x = torch.linspace(-6, 6, 4001, dtype=torch.float64).requires_grad_(True)
    d_out = torch.rand(4001, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    F.gelu(x).backward(d_out)
    d_x, out = torch.empty_like(x), torch.empty_like(x)
    gelu_backward(d_out, x.detach(), d_x, exact=True)
    gelu_forward(x.detach(), out, exact=True)
    assert torch.allclose(d_x, x.grad, rtol=1e-12, atol=1e-12) and torch.equal(out, F.gelu(x.detach()))


@pytest.mark.slow
def test_gpt2_finetune_trains_a_nanogpt_checkpoint(tmp_path: Path) -> None:
    nanogpt_checkpoint(tmp_path / "ckpt.pt")
    texts = tmp_path / "notes.txt"
    texts.write_text("Return the value of the key in the mapping. " * 60, encoding="utf-8")
    code, err = cli("finetune", str(texts), "--weights", str(tmp_path / "ckpt.pt"), "--out", str(tmp_path / "run"),
                    "--steps", "3", "--context", "32", "--batch-size", "2", "--val-fraction", "0.2")
    assert code == 0, err
    tuned = GPT2.from_pretrained(tmp_path / "run")  # the best checkpoint, in the official layout
    assert tuned.config.activation_function == "gelu"  # the exported checkpoint keeps nanoGPT's GELU


@pytest.mark.long
def test_gguf_files_carry_llamacpps_names_and_tokenizer_and_read_back(trained_dir: Path, trained_model: GPT2,
                                                                     tmp_path: Path) -> None:
    """gpt2 convert --to gguf writes what llama.cpp's gpt2 loader reads (checked with gguf-py's own reader: the
    architecture, hyperparameters, tokenizer metadata, tensor names, types and shapes); the engine reads the file
    back: f32 to the bit, f16 and q8_0 with the float32 model's top-1 token at >= 99% of positions."""
    gguf = pytest.importorskip("gguf", reason="gguf (llama.cpp's gguf-py) is part of the test extra")
    c = trained_model.config
    from train_fixture import unseen

    # text the fixture was not trained on, not random ids: those make near-tied logits, and on a fixture trained on an
    # AMX Xeon q8_0 kept the top-1 at 98.8-98.9% of random-id positions (99.7% of these)
    ids = torch.tensor(trained_model.tokenizer.encode(" ".join(unseen()[:40]))[:1024]).view(4, 256)
    want = trained_model(ids)
    for qtype in ("f32", "f16", "q8_0"):
        path = tmp_path / f"m-{qtype}.gguf"
        assert cli("convert", str(trained_dir), str(path), "--to", "gguf", "--type", qtype)[0] == 0
        reader = gguf.GGUFReader(str(path))
        field = lambda key, reader=reader: reader.get_field(key).contents()  # noqa: E731
        assert field("general.architecture") == "gpt2"
        assert (field("gpt2.context_length"), field("gpt2.embedding_length"), field("gpt2.block_count"),
                field("gpt2.attention.head_count"), field("gpt2.feed_forward_length")) == (
                    c.n_positions, c.n_embd, c.n_layer, c.n_head, 4 * c.n_embd)
        assert (field("tokenizer.ggml.model"), field("tokenizer.ggml.pre")) == ("gpt2", "gpt-2")
        tokens = field("tokenizer.ggml.tokens")
        assert len(tokens) == VOCAB and tokens[50256] == "<|endoftext|>" and tokens[262] == "Ġthe"
        assert field("tokenizer.ggml.merges")[0] == "Ġ t"
        assert field("tokenizer.ggml.eos_token_id") == field("tokenizer.ggml.bos_token_id") == 50256
        tensors = {t.name: t for t in reader.tensors}
        assert set(tensors) == {"token_embd.weight", "position_embd.weight", "output_norm.weight", "output_norm.bias",
                                "output.weight"} | {f"blk.{i}.{n}.{p}" for i in range(c.n_layer) for n in (
                                    "attn_norm", "attn_qkv", "attn_output", "ffn_norm", "ffn_up", "ffn_down")
                                    for p in ("weight", "bias")}
        assert list(tensors["blk.0.attn_qkv.weight"].shape) == [c.n_embd, 3 * c.n_embd]  # ggml's ne: (in, out)
        matrix = tensors["blk.0.ffn_up.weight"].tensor_type.name
        assert matrix == qtype.upper() and tensors["blk.0.ffn_up.bias"].tensor_type.name == "F32"
        got = GPT2.from_pretrained(path)(ids)
        if qtype == "f32":
            assert torch.equal(got, want)
        else:
            assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.99
    back = tmp_path / "back"
    assert cli("convert", str(tmp_path / "m-f32.gguf"), str(back), "--to", "hf")[0] == 0
    assert torch.equal(GPT2.from_pretrained(back)(ids), want)
    nanogpt_checkpoint(tmp_path / "ckpt.pt", steps=1)
    code, err = cli("convert", str(tmp_path / "ckpt.pt"), str(tmp_path / "n.gguf"), "--to", "gguf")
    assert code == 2 and "llama.cpp's gpt2 computes the tanh GELU" in err
