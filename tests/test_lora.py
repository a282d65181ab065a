"""LoRA (core/lora.py): the adapters' hand-written gradients against autograd through PEFT's LoRA layers on
transformers' model, the file format both ways (an engine adapter in peft, a peft adapter in the engine), merging,
and QLoRA's frozen quantized base."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from conftest import run_pass
from test_training import TINY, fed_dropout, hf_model, random_batch, tiny_weights

from gpt2_engine.core.config import GPT2Config
from gpt2_engine.core.lora import (LoraAdapter, LoraError, LoraSettings, attach, merge, new_adapter, parse_targets,
                                   trainable)
from gpt2_engine.formats.peft import load_adapter, save_adapter
from gpt2_engine.core.model import forward, query_blocks
from gpt2_engine.core.weights import GPT2Weights
from gpt2_engine.train.step import Buffers, adapter_gradients, forward_loss


def peft_model(w: GPT2Weights, config: GPT2Config, adapter: LoraAdapter, dtype: torch.dtype, dropout: float):
    """transformers' model with `w`, wrapped by peft with the same adapter's values (through peft's own state-dict
    loader, from the keys the engine writes)."""
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict

    s = adapter.settings
    model = get_peft_model(hf_model(w, config, dtype, dropout),
                           LoraConfig(r=s.r, lora_alpha=s.alpha, lora_dropout=s.dropout, target_modules=list(s.targets),
                                      fan_in_fan_out=True, use_rslora=s.rslora))
    model = model.to(dtype)
    state = {"base_model.model.transformer." + k + ".weight": t.t().to(dtype) for k, t in adapter.tensors.items()}
    result = set_peft_model_state_dict(model, state)
    assert not result.unexpected_keys, result.unexpected_keys
    return model.train()


def lora_masks(buf: Buffers, settings: LoraSettings) -> list[torch.Tensor]:
    """The engine's dropout masks in PEFT's order: per block the c_attn adapter's, the attention's, c_proj's adapter's,
    the residual's, c_fc's and mlp.c_proj's adapters', the residual's (the embedding's first)."""
    B, T = buf.batch, buf.context
    masks = [] if buf.embed_keep is None else [buf.embed_keep]

    def adapter(a, field: str) -> list[torch.Tensor]:
        act = a.adapters.get(field)
        return [] if act is None or act.keep is None else [act.keep.view(B, T, -1)]

    for a in buf.layers:
        att = []
        if a.att_keep is not None:
            full = torch.zeros(B, a.att_keep[0].shape[1], T, T, dtype=a.att_keep[0].dtype)
            for (i, j, _), keep in zip(query_blocks(T, T), a.att_keep):
                full[:, :, i:j, :j] = keep
            att = [full]
        masks += adapter(a, "c_attn") + att + adapter(a, "attn_c_proj") + ([a.attn_keep] if a.attn_keep is not None else [])
        masks += adapter(a, "c_fc") + adapter(a, "mlp_c_proj") + ([a.mlp_keep] if a.mlp_keep is not None else [])
    return [m.clone() for m in masks]


def random_adapter(config: GPT2Config, settings: LoraSettings, seed: int, dtype: torch.dtype) -> LoraAdapter:
    """A fresh adapter with B made nonzero too (a new one's B is 0, which would leave A without a gradient)."""
    ad = new_adapter(config, settings, torch.Generator().manual_seed(seed), dtype=dtype)
    g = torch.Generator().manual_seed(seed + 1)
    return LoraAdapter(settings, {k: (t if k.endswith("lora_A") else 0.3 * torch.randn(t.shape, generator=g, dtype=dtype))
                                  for k, t in ad.tensors.items()})


def compare_lora(w: GPT2Weights, config: GPT2Config, settings: LoraSettings, B: int, T: int, dtype: torch.dtype,
                 dropout: float, rel: float, loss_rel: float, head_rows: int = 1024) -> None:
    ids, targets = random_batch(config, B, T, seed=T)
    adapter = random_adapter(config, settings, 5, dtype)
    attached, params = trainable(w, adapter)
    grads_w, grads = adapter_gradients(attached, config, settings)
    buf = Buffers.allocate(config, B, T, dropout, dtype, head_rows=head_rows, lora=settings)
    loss = forward_loss(attached, config, buf, ids, targets, grads=grads_w, generator=torch.Generator().manual_seed(7))

    model = peft_model(w, config, adapter, dtype, dropout)
    with fed_dropout(lora_masks(buf, settings)):
        logits = model(input_ids=ids).logits
    ref_loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                                 ignore_index=-1, reduction="sum")
    ref_loss.backward()
    assert abs(loss - ref_loss.item()) <= loss_rel * abs(ref_loss.item()), (loss, ref_loss.item())
    ref = {k.removeprefix("base_model.model.transformer.").replace(".default.weight", ""): p.grad
           for k, p in model.named_parameters() if p.requires_grad}
    assert set(ref) == set(grads), sorted(set(ref) ^ set(grads))
    for name, g in grads.items():
        r = ref[name].t()  # peft's nn.Linear orientation -> the engine's Conv1D one
        diff, scale = (g - r).abs().max().item(), r.abs().max().item()
        assert scale > 0 and diff <= rel * scale, f"{name}: max |diff| {diff:.3g} > {rel} x max |grad| {scale:.3g}"


@pytest.mark.parametrize("dropout, lora_dropout", [(0.0, 0.0), (0.1, 0.2)])
@pytest.mark.parametrize("targets, rslora", [("c_attn,attn.c_proj,c_fc,mlp.c_proj", False), ("c_attn,mlp.c_proj", True)])
def test_adapter_gradients_match_peft_autograd_in_float64(dropout: float, lora_dropout: float, targets: str,
                                                          rslora: bool) -> None:
    settings = LoraSettings(r=3, alpha=5.0, dropout=lora_dropout, targets=targets, rslora=rslora)
    compare_lora(tiny_weights(2, torch.float64), TINY, settings, 2, 9, torch.float64, dropout, rel=1e-10,
                 loss_rel=1e-12, head_rows=5)  # the head's row chunks, and a last short one, exercised


def test_adapter_gradients_match_peft_autograd_in_float32_on_the_trained_checkpoint(trained_model) -> None:
    config = trained_model.config
    # the trained fixture is trained on the machine that runs the tests, so its weights differ between CPUs: the loss
    # (a float32 sum of 48 cross-entropies of ~17) was 3.3e-6 off on an AVX2-only EPYC's checkpoint, 1e-6 on Zen 4's
    compare_lora(trained_model.weights, config, LoraSettings(r=8, alpha=16.0), 2, 24, torch.float32, 0.0, rel=1e-4,
                 loss_rel=1e-5)


def test_targets_are_parsed_as_peft_names_them() -> None:
    assert parse_targets("c_proj") == ("attn.c_proj", "mlp.c_proj")
    assert parse_targets(" mlp.c_proj, attn.c_attn ") == ("c_attn", "mlp.c_proj")
    with pytest.raises(LoraError, match=r"LoRA target 'q_proj': expected some of c_attn, attn.c_proj, c_fc, mlp.c_proj"):
        parse_targets("q_proj")
    with pytest.raises(LoraError, match=r"LoRA rank r: expected an integer >= 1, got 0"):
        LoraSettings(r=0)


# --- files: the engine's adapters in peft, peft's in the engine, merging ---------------------------------------------

def max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


PROMPT = torch.tensor([[464, 2746, 318, 257, 1332, 286, 262, 7071, 11, 290, 340, 373]])


def test_an_engine_adapter_loads_in_peft_with_the_same_logits(trained_dir: Path, tmp_path: Path) -> None:
    from conftest import reference
    from peft import PeftModel

    from gpt2_engine import GPT2

    config = GPT2Config.from_json(trained_dir / "config.json")
    adapter = random_adapter(config, LoraSettings(r=4, alpha=8.0, targets="c_attn,c_fc,mlp.c_proj"), 11, torch.float32)
    save_adapter(tmp_path / "ad", LoraAdapter(adapter.settings, adapter.tensors, str(trained_dir)))
    saved = json.loads((tmp_path / "ad" / "adapter_config.json").read_text())
    assert saved["peft_type"] == "LORA" and saved["fan_in_fan_out"] is True and saved["r"] == 4
    assert saved["target_modules"] == ["c_attn", "c_fc", "mlp.c_proj"]

    peft = PeftModel.from_pretrained(reference(trained_dir), tmp_path / "ad").eval()
    with torch.no_grad():
        ref = peft(input_ids=PROMPT).logits
        base = reference(trained_dir)(input_ids=PROMPT).logits
    engine = GPT2.from_pretrained(trained_dir, lora=tmp_path / "ad")
    got = engine(PROMPT)
    assert max_rel(got, ref) <= 1e-5
    assert max_rel(base, ref) > 1e-2  # the adapter changes the logits: the comparison above is not the base's


@pytest.mark.parametrize("targets, layers", [(["c_fc", "attn.c_proj"], [1, 3]), (r".*\.h\.[02]\.attn\.c_attn", None)])
def test_peft_adapters_on_some_layers_match_peft(trained_dir: Path, tmp_path: Path, targets: list[str] | str,
                                                 layers: list[int] | None) -> None:
    """PEFT's own adapters restricted by layers_to_transform, or by a regular expression, load (their config's
    selection checked against their tensors) and give PEFT's logits."""
    from conftest import reference
    from peft import LoraConfig, get_peft_model

    from gpt2_engine import GPT2

    torch.manual_seed(0)
    peft = get_peft_model(reference(trained_dir), LoraConfig(r=4, lora_alpha=8, target_modules=targets,
                                                              layers_to_transform=layers, fan_in_fan_out=True,
                                                              init_lora_weights=False))
    peft.save_pretrained(tmp_path / "peft")
    with torch.no_grad():
        ref = peft.eval()(input_ids=PROMPT).logits
    engine = GPT2.from_pretrained(trained_dir, lora=tmp_path / "peft")
    assert len(engine.lora.tensors) == 2 * (4 if layers else 2)
    assert max_rel(engine(PROMPT), ref) <= 1e-5


def test_a_peft_adapter_loads_in_the_engine_and_merges(trained_dir: Path, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture) -> None:
    from conftest import reference
    from peft import LoraConfig, get_peft_model

    from gpt2_engine import GPT2

    torch.manual_seed(0)
    peft = get_peft_model(reference(trained_dir), LoraConfig(r=6, lora_alpha=12, target_modules=["c_attn", "c_proj"],
                                                              fan_in_fan_out=True, init_lora_weights=False))
    peft.save_pretrained(tmp_path / "peft")
    with torch.no_grad():
        ref = peft.eval()(input_ids=PROMPT).logits
    engine = GPT2.from_pretrained(trained_dir, lora=tmp_path / "peft")
    assert engine.lora.settings.targets == ("c_attn", "attn.c_proj", "mlp.c_proj") and engine.lora.settings.r == 6
    assert max_rel(engine(PROMPT), ref) <= 1e-5

    from gpt2_engine.cli import main

    assert main(["merge-lora", str(trained_dir), str(tmp_path / "peft"), str(tmp_path / "merged")]) == 0
    merged = GPT2.from_pretrained(tmp_path / "merged")
    assert max_rel(merged(PROMPT), ref) <= 1e-5
    with torch.no_grad():
        merged_hf = reference(tmp_path / "merged")(input_ids=PROMPT).logits
    assert max_rel(merged_hf, ref) <= 1e-5

    # a model already in OUT is replaced only when asked; the adapter's own folder never
    again = ["merge-lora", str(trained_dir), str(tmp_path / "peft"), str(tmp_path / "merged")]
    before = (tmp_path / "merged" / "model.safetensors").stat().st_mtime_ns
    capsys.readouterr()
    assert main(again) == 2
    assert capsys.readouterr().err == (f"gpt2 merge-lora: error: {tmp_path / 'merged'}: already holds a model "
                                       "(config.json, model.safetensors); pass --overwrite to replace it, or write "
                                       "somewhere else\n")
    assert (tmp_path / "merged" / "model.safetensors").stat().st_mtime_ns == before
    assert main(again + ["--overwrite"]) == 0
    assert main(["merge-lora", str(trained_dir), str(tmp_path / "peft"), str(tmp_path / "peft"), "--overwrite"]) == 2
    assert capsys.readouterr().err.endswith(f"error: {tmp_path / 'peft'}: is the adapter itself; write the merged "
                                            "model somewhere else\n")
    inside = trained_dir / "last"  # not made: refused before anything is written
    assert main(["merge-lora", str(trained_dir), str(tmp_path / "peft"), str(inside), "--overwrite"]) == 2
    assert capsys.readouterr().err.endswith(f"error: {inside}: is inside the base checkpoint {trained_dir}; write the "
                                            "merged model somewhere else\n")
    last = tmp_path / "run" / "last"  # an adapter run's resume state: a model beside it would be neither
    shutil.copytree(tmp_path / "peft", last)
    (last / "trainer_state.json").write_text("{}")
    assert main(["merge-lora", str(trained_dir), str(tmp_path / "peft"), str(last), "--overwrite"]) == 2
    assert capsys.readouterr().err.endswith(f"error: {last}: holds an adapter or a run's resume state "
                                            "(adapter_config.json, trainer_state.json); write the merged model "
                                            "somewhere else\n")
    (tmp_path / "peftlink").symlink_to(tmp_path / "peft")
    for inside in (tmp_path / "peft" / "sub", tmp_path / "peftlink" / "new"):  # the model would join the adapter
        assert main(["merge-lora", str(trained_dir), str(tmp_path / "peft"), str(inside), "--overwrite", "--force"]) == 2
        assert capsys.readouterr().err.endswith(f"error: {inside}: is inside the adapter {tmp_path / 'peft'}; write "
                                                "the merged model somewhere else\n")
    assert sorted(p.name for p in (tmp_path / "peft").iterdir()) == ["README.md", "adapter_config.json",
                                                                      "adapter_model.safetensors"]
    # a FIFO in OUT is never written into: the merge blocked on it, after model.safetensors had been replaced
    (tmp_path / "merged" / "config.json").unlink()
    os.mkfifo(tmp_path / "merged" / "config.json")
    before = (tmp_path / "merged" / "model.safetensors").stat().st_mtime_ns
    assert main(again + ["--overwrite"]) == 2
    assert capsys.readouterr().err.endswith(f"error: {tmp_path / 'merged' / 'config.json'}: a FIFO, not a regular "
                                            "file; a checkpoint's files are replaced, never written into\n")
    assert (tmp_path / "merged" / "model.safetensors").stat().st_mtime_ns == before


def test_adapter_files_are_checked(trained_dir: Path, tmp_path: Path) -> None:
    config = GPT2Config.from_json(trained_dir / "config.json")
    with pytest.raises(LoraError, match=r"no adapter_config.json; not a PEFT adapter directory"):
        load_adapter(trained_dir, config)
    adapter = random_adapter(config, LoraSettings(r=2), 1, torch.float32)
    save_adapter(tmp_path / "ad", adapter)
    cfg = json.loads((tmp_path / "ad" / "adapter_config.json").read_text())
    (tmp_path / "ad" / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    with pytest.raises(LoraError, match=r"use_dora=True is not supported"):
        load_adapter(tmp_path / "ad", config)
    (tmp_path / "ad" / "adapter_config.json").write_text(json.dumps({**cfg, "r": 3}))
    with pytest.raises(LoraError, match=r"r=3, but the tensors have rank \[2\]"):
        load_adapter(tmp_path / "ad", config)
    wide = GPT2Config(vocab_size=config.vocab_size, n_positions=config.n_positions, n_embd=config.n_embd * 2,
                      n_layer=config.n_layer, n_head=config.n_head)
    (tmp_path / "ad" / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(LoraError, match=r"lora_A.weight has shape \[2, \d+\], expected \[2, \d+\] for this model"):
        load_adapter(tmp_path / "ad", wide)


def test_several_adapters_on_one_base_give_each_row_its_own(trained_model) -> None:
    """attach() stacks adapters of different ranks and targets; a pass whose rows use different ones (and the base)
    gives each sequence exactly what its adapter alone gives: the row-invariant kernels' and lora_rows' bits."""
    from gpt2_engine.core.model import KVCache
    from gpt2_engine.runtime.plan import Segment

    config, w = trained_model.config, trained_model.weights
    ads = [random_adapter(config, LoraSettings(r=r, targets=t), r, torch.float32)
           for r, t in ((2, "c_attn"), (8, "c_fc,mlp.c_proj,attn.c_proj"), (4, "c_attn,c_fc"))]
    prompts = [[464, 2746, 318, 257], [1332, 286], [262, 7071, 11], [290, 340, 373, 257, 11]]
    which = [1, -1, 0, 2]
    cache = KVCache.allocate(config, 4, 16)
    got = run_pass(attach(w, ads), config, [Segment(i, 0, p, k) for i, (p, k) in enumerate(zip(prompts, which))],
                           cache)
    for i, (p, k) in enumerate(zip(prompts, which)):
        alone = run_pass(attach(w, [ads[k]]) if k >= 0 else w, config, [Segment(0, 0, p)],
                                 KVCache.allocate(config, 1, 16))
        assert torch.equal(got[i], alone[0]), i
    whole = forward(attach(w, [ads[2]]), config, torch.tensor([prompts[3]]))[0, -1]
    assert max_rel(got[3], whole) <= 1e-5  # the whole-sequence forward (prefill) agrees to rounding


def test_merge_needs_a_float32_base(trained_dir: Path) -> None:
    from gpt2_engine import GPT2

    m = GPT2.from_pretrained(trained_dir, quantize="int8")
    adapter = random_adapter(m.config, LoraSettings(r=2), 1, torch.float32)
    with pytest.raises(LoraError, match=r"merge: the base must be float32"):
        merge(m.weights, adapter)


# --- QLoRA: the frozen base quantized ---------------------------------------------------------------------------------

@pytest.mark.parametrize("bits", [8, 4])
def test_dequantized_columns_are_the_quantized_weights(bits: int) -> None:
    from gpt2_engine.core.projection import dequantize_columns
    from gpt2_engine.core.quantize import dequantize, quantize_matrix

    w = torch.randn(96, 70, generator=torch.Generator().manual_seed(bits))
    m = quantize_matrix(w, bits)
    full = dequantize(m)
    assert torch.equal(dequantize_columns(m, 0, 70), full)
    assert torch.equal(dequantize_columns(m, 32, 70, torch.empty(96 * 48)), full[:, 32:])  # the last panel padded
    with pytest.raises(ValueError, match="first column 5 is not a multiple of 16"):
        dequantize_columns(m, 5, 20)


def test_frozen_quantized_layers_pass_gradients_through_the_dequantized_weights() -> None:
    from gpt2_engine.core.projection import dequantize_columns
    from gpt2_engine.core.quantize import dequantize, quantize_matrix
    from gpt2_engine.core.weights import Linear
    from gpt2_engine.train.backward import head_cross_entropy, linear_backward

    g = torch.Generator().manual_seed(3)
    m = quantize_matrix(torch.randn(64, 48, generator=g), 4)
    d_out, d_x = torch.randn(10, 48, generator=g), torch.empty(10, 64)
    linear_backward(d_out, torch.randn(10, 64), Linear(m, torch.zeros(48)), None, d_x, torch.empty(64 * 48))
    assert torch.equal(d_x, d_out @ dequantize(m).t())

    V, C = 5000, 64  # a head of more than one HEAD_BLOCK chunk
    head = quantize_matrix(torch.randn(C, V, generator=g) * 0.1, 8)  # (C, V), as quantize_weights packs wte^T
    x, targets = torch.randn(12, C, generator=g), torch.randint(0, V, (12,), generator=g)
    d_q, d_f = torch.empty(12, C), torch.empty(12, C)
    loss_q = head_cross_entropy(x, head, targets, torch.empty(V, 12), 1.0, None, d_q, torch.empty(C * 4112))
    wte = dequantize_columns(head, 0, V).t().contiguous()  # (V, C)
    loss_f = head_cross_entropy(x, wte, targets, torch.empty(V, 12), 1.0, None, d_f)
    assert abs(loss_q - loss_f) <= 1e-3 * abs(loss_f)  # the forward quantizes the activations to int8 too
    assert max_rel(d_q, d_f) <= 1e-2


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_a_qlora_evaluation_is_the_quantized_model_with_its_adapter(trained_dir: Path, tmp_path: Path, fmt: str) -> None:
    """The training forward on a quantized base computes what inference computes: the same blockwise kernel, so the
    loss of forward_loss equals the cross-entropy of GPT2.from_pretrained(quantize=..., lora=...)'s logits."""
    from gpt2_engine import GPT2

    model = GPT2.from_pretrained(trained_dir, quantize=fmt)
    config = model.config
    adapter = random_adapter(config, LoraSettings(r=4), 9, torch.float32)
    save_adapter(tmp_path / "ad", adapter)
    attached, _ = trainable(model.weights, adapter)
    ids, targets = random_batch(config, 2, 16, seed=4)
    buf = Buffers.allocate(config, 2, 16, lora=adapter.settings, quantized=True)
    loss = forward_loss(attached, config, buf, ids, targets)
    served = GPT2.from_pretrained(trained_dir, quantize=fmt, lora=tmp_path / "ad")
    logits = served(ids)
    ref = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum")
    # The projections and the head are the one kernel on both sides (row-invariant, checked in test_kernels), but the
    # layers between them (layer norms, the LoRA term) round differently in the training forward, and a 1-ulp
    # difference can move an activation across an int8 rounding boundary of the kernel's activation quantization:
    # 3.3e-5 measured with int4 on an AVX2-only EPYC's trained checkpoint (a checkpoint trained on that machine)
    assert abs(loss - ref.item()) <= 1e-4 * ref.item()


# --- gpt2 finetune --lora ---------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_finetune_lora_trains_an_adapter_peft_loads_and_merges(trained_dir: Path, tmp_path: Path) -> None:
    from conftest import reference
    from peft import PeftModel
    from test_finetune import corpus, finetune, logged, small_run

    from gpt2_engine import GPT2

    out, log = tmp_path / "out", tmp_path / "log.jsonl"
    done = finetune(*small_run(trained_dir, corpus(tmp_path), out, "--steps", "8", "--eval-every", "4", "--lr",
                               "1e-2", "--lora", "4", "--lora-targets", "c_attn,c_fc", "--merge", "--log", str(log)))
    assert done.returncode == 0, done.stderr
    evals = logged(log, "eval")
    assert evals[-1]["val_loss"] < evals[0]["val_loss"] - 0.3, evals
    assert logged(log, "started")[0]["parameters"] == 4 * 4 * ((256 + 768) + (256 + 1024))  # 4 layers, C = 256
    assert "adapter saved in" in done.stderr and f"merged in is saved in {out / 'merged'}" in done.stderr
    assert sorted(p.name for p in out.iterdir()) == ["adapter_base.json", "adapter_config.json", "adapter_model.safetensors",
                                                     "last", "merged"]

    ids = torch.tensor([[464, 2746, 318, 257, 1332, 286]])
    peft = PeftModel.from_pretrained(reference(trained_dir), out).eval()
    with torch.no_grad():
        ref = peft(input_ids=ids).logits
    assert max_rel(GPT2.from_pretrained(trained_dir, lora=out)(ids), ref) <= 1e-5
    assert max_rel(GPT2.from_pretrained(out / "merged")(ids), ref) <= 1e-5


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_qlora_resumes_exactly(trained_dir: Path, tmp_path: Path, fmt: str) -> None:
    """A QLoRA run stopped after its save at update 3 and resumed logs the uninterrupted run's losses and ends with
    the same adapter file."""
    from test_finetune import corpus, small_run

    from gpt2_engine.cli import build_parser
    from gpt2_engine.commands.finetune import build_trainer

    data = corpus(tmp_path)

    def trainer(out: Path, *extra: str):
        args = build_parser().parse_args(["finetune", *small_run(trained_dir, data, out, "--steps", "6", "--save-every",
                                                                  "3", "--lora", "2", "--lora-dropout", "0.1",
                                                                  "--dropout", "0.1", "--quantize", fmt, *extra)])
        return build_trainer(args, None)

    whole = [e.loss for e in trainer(tmp_path / "whole").run() if type(e).__name__ == "Step"]
    first = trainer(tmp_path / "cut")
    losses = []
    for e in first.run():
        losses += [e.loss] if type(e).__name__ == "Step" else []
        if type(e).__name__ == "Saved":
            break
    losses += [e.loss for e in trainer(tmp_path / "cut", "--resume").run() if type(e).__name__ == "Step"]
    assert losses == whole and len(whole) == 6
    name = "adapter_model.safetensors"
    assert (tmp_path / "cut" / name).read_bytes() == (tmp_path / "whole" / name).read_bytes()


@pytest.mark.parametrize("extra, message", [
    (("--quantize", "int4"), "--quantize needs --lora R (QLoRA; full fine-tuning trains float32 weights)"),
    (("--merge",), "--merge needs --lora R"),
    (("--lora", "4", "--init", "small"), "--lora adapts a pretrained model; --init trains one from scratch"),
    (("--lora", "4", "--lora-targets", "q_proj"), "LoRA target 'q_proj': expected some of c_attn, attn.c_proj"),
])
def test_finetune_lora_bad_flags_are_one_line(trained_dir: Path, tmp_path: Path, extra: tuple[str, ...],
                                              message: str) -> None:
    from test_finetune import corpus, finetune, small_run

    done = finetune(*small_run(trained_dir, corpus(tmp_path), tmp_path / "out", "--steps", "2", *extra))
    assert done.returncode == 2
    lines = [line for line in done.stderr.splitlines() if "error:" in line]
    assert len(lines) == 1 and message in lines[0], done.stderr


def test_resume_refuses_other_lora_settings(trained_dir: Path, tmp_path: Path) -> None:
    from test_finetune import corpus, finetune, small_run

    data, out = corpus(tmp_path), tmp_path / "out"
    assert finetune(*small_run(trained_dir, data, out, "--steps", "2", "--lora", "2")).returncode == 0
    again = finetune(*small_run(trained_dir, data, out, "--steps", "2", "--lora", "4", "--resume"))
    assert again.returncode == 2
    assert again.stderr.strip().splitlines() == [
        f"gpt2 finetune: error: --resume: the LoRA settings (--lora, --lora-*) differ from the run saved in "
        f"{out / 'last'} (resume with the same data, --weights/--init and settings, or start a new run)"]


# --- gpt2 serve --lora NAME=DIR ---------------------------------------------------------------------------------------

def test_many_adapters_served_together_equal_each_served_alone(trained_model, tmp_path: Path) -> None:
    """8 clients on 4 adapters and the base share one server's passes; every output equals the same request on a
    server with that adapter alone, token for token (greedy and seeded sampling)."""
    import concurrent.futures

    import httpx
    from test_serve import live

    config = trained_model.config
    adapters = []
    for k in range(4):
        ad = random_adapter(config, LoraSettings(r=2 + 2 * k, targets=("c_attn,c_fc", "c_proj", "c_attn", "c_fc")[k]),
                            20 + k, torch.float32)
        save_adapter(tmp_path / f"ad{k}", LoraAdapter(ad.settings, {n: t * 0.5 for n, t in ad.tensors.items()}))
        adapters.append((f"task{k}", tmp_path / f"ad{k}"))
    prompts = ["Return the number of", "The default value of", "Raise an error if", "If the list is empty"]
    jobs = [(name, prompts[i % 4], {"temperature": 0} if i % 2 else {"temperature": 1.0, "seed": i})
            for i, name in enumerate(["gpt2"] + [n for n, _ in adapters] * 2 + ["gpt2"])]

    def ask(url: str, job: tuple[str, str, dict]) -> list[int]:
        name, prompt, sampling = job
        r = httpx.post(f"{url}/v1/completions", json={"model": name, "prompt": prompt, "max_tokens": 12, "logprobs": 0,
                                                      **sampling}, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == name
        return r.json()["choices"][0]["logprobs"]["tokens"], r.json()["choices"][0]["logprobs"]["token_logprobs"]

    with live(trained_model, parallel=4, max_queue=16, adapters=tuple(adapters)) as (url, _):
        models = httpx.get(f"{url}/v1/models").json()["data"]
        assert [m["id"] for m in models] == ["gpt2", "task0", "task1", "task2", "task3"]
        assert models[2]["parent"] == "gpt2" and models[2]["root"] == str(tmp_path / "ad1")
        missing = httpx.post(f"{url}/v1/completions", json={"model": "task9", "prompt": "x", "max_tokens": 1})
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
        assert "'gpt2', 'task0', 'task1', 'task2', 'task3'" in missing.json()["error"]["message"]
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            together = list(pool.map(lambda job: ask(url, job), jobs))
    outputs = {}
    for name, path in [("gpt2", None)] + adapters:
        with live(trained_model, parallel=4, max_queue=16, adapters=((name, path),) if path else ()) as (url, _):
            for i, job in enumerate(jobs):
                if job[0] == name:
                    outputs[i] = ask(url, job)
    assert together == [outputs[i] for i in range(len(jobs))]
    assert len({tuple(t) for t, _ in together}) > 4  # the adapters do change the text


def test_serve_lora_flags_are_checked(trained_dir: Path, tmp_path: Path) -> None:
    from conftest import cli

    def serve(*args: str) -> tuple[int, str]:
        return cli("serve", "--weights", str(trained_dir), "--port", "0", *args)

    assert serve("--lora", "task") == (2, "gpt2 serve: error: --lora 'task': expected NAME=DIR (the model id clients "
                                          "ask for, and a PEFT adapter directory)\n")
    assert serve("--lora", f"gpt2={tmp_path}") == (2, f"gpt2 serve: error: --lora 'gpt2={tmp_path}': the model id "
                                                      "'gpt2' is already taken by the base (--model-name)\n")
    code, err = serve("--lora", f"a={tmp_path}")
    assert code == 2 and err == (f"gpt2 serve: error: --lora a={tmp_path}: {tmp_path}: no adapter_config.json; "
                                 "not a PEFT adapter directory\n")


@pytest.mark.parametrize("lora", [None, LoraSettings(r=3, alpha=5.0, dropout=0.2)])
def test_recompute_gives_the_same_gradients_bit_for_bit(lora: LoraSettings | None) -> None:
    """Activation recomputation keeps one block's activations and runs each block's forward again in the backward,
    with the same dropout masks: the gradients, the loss and the generator's state afterwards are the same bits."""
    from gpt2_engine.core.weights import named_tensors
    from gpt2_engine.train.step import zeros_like

    w = tiny_weights(4, torch.float32)
    ids, targets = random_batch(TINY, 2, 40, seed=1)
    results = []
    for recompute in (False, True):
        if lora is None:
            model, grads_w = w, zeros_like(w, TINY)
            grads = named_tensors(grads_w)
        else:
            model, _ = trainable(w, random_adapter(TINY, lora, 3, torch.float32))
            grads_w, grads = adapter_gradients(model, TINY, lora)
        buf = Buffers.allocate(TINY, 2, 40, 0.1, lora=lora, recompute=recompute)
        gen = torch.Generator().manual_seed(5)
        loss = forward_loss(model, TINY, buf, ids, targets, grads=grads_w, generator=gen)
        results.append((loss, {k: g.clone() for k, g in grads.items()}, gen.get_state()))
    (l0, g0, s0), (l1, g1, s1) = results
    assert l0 == l1 and torch.equal(s0, s1)
    assert all(torch.equal(g0[k], g1[k]) for k in g0)
    shared = Buffers.allocate(TINY, 2, 40, recompute=True).layers
    assert shared[1].heads is shared[0].heads and shared[1].pre is shared[0].pre and shared[1].x is not shared[0].x


def test_python_api_trains_an_adapter_on_a_quantized_model(trained_dir: Path, tmp_path: Path) -> None:
    from gpt2_engine import GPT2, GPT2EngineError

    model = GPT2.from_pretrained(trained_dir, quantize="int8")
    prompt = torch.tensor([model.tokenizer.encode("Return the value of")])
    before = model(prompt)
    texts = ["Return the value of the list given as input and raise an error when it is missing."] * 40
    result = model.finetune(texts, lora=4, steps=4, context=16, batch_size=2, lr=1e-2, out=tmp_path / "ad")
    assert result.steps == 4 and model.lora is not None and model.lora.settings.r == 4
    assert max_rel(model(prompt), before) > 1e-3  # the model now runs with its trained adapter
    again = GPT2.from_pretrained(trained_dir, quantize="int8", lora=tmp_path / "ad")  # the best, saved in PEFT's format
    assert again.lora.settings == model.lora.settings
    with pytest.raises(GPT2EngineError, match=r"the model already carries an adapter"):
        model.finetune(texts, lora=4, steps=1)
    with pytest.raises(GPT2EngineError, match=r"finetune trains float32 weights; .*lora=R"):
        again.finetune(texts, steps=1)


def test_an_adapter_records_its_base_and_refuses_another(trained_dir: Path, tmp_path: Path) -> None:
    """The adapter's files carry its base's fingerprint: another base of the same shape is a one-line error unless
    forced (Python, gpt2 generate, gpt2 merge-lora), and --lora without --weights loads the base it records."""
    import subprocess
    import sys

    from conftest import edited_copy

    from gpt2_engine import GPT2
    from gpt2_engine.core.lora import LoraError
    from gpt2_engine.formats.peft import load_adapter
    from gpt2_engine.formats.hf import weights_fingerprint

    model = GPT2.from_pretrained(trained_dir)
    with pytest.warns(UserWarning, match="only 16 validation tokens"):
        model.finetune(["Return the value of the key. " * 40], lora=2, steps=2, context=32, batch_size=2,
                       out=tmp_path / "ad")
    adapter = load_adapter(tmp_path / "ad", model.config)
    assert adapter.base == str(trained_dir.resolve()) and adapter.base_fingerprint == weights_fingerprint(trained_dir)
    other = edited_copy(trained_dir, tmp_path / "other", lambda t: t["h.3.mlp.c_fc.bias"].add_(0.01))
    assert weights_fingerprint(other) != weights_fingerprint(trained_dir)  # one bias in the last block changed

    with pytest.raises(LoraError, match=r"this adapter was trained on another base .* than .*other \(fingerprint"):
        GPT2.from_pretrained(other, lora=tmp_path / "ad")
    forced = GPT2.from_pretrained(other, lora=tmp_path / "ad", force=True)
    assert forced.lora is not None

    def gpt2(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "gpt2_engine", *args], capture_output=True, text=True, timeout=300)

    refused = gpt2("generate", "Return", "-n", "3", "--weights", str(other), "--lora", str(tmp_path / "ad"))
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1
    assert "this adapter was trained on another base" in refused.stderr and "pass --force" in refused.stderr
    assert gpt2("generate", "Return", "-n", "3", "--weights", str(other), "--lora", str(tmp_path / "ad"),
                "--force").returncode == 0
    merged = gpt2("merge-lora", str(other), str(tmp_path / "ad"), str(tmp_path / "merged"))
    assert merged.returncode == 2 and "trained on another base" in merged.stderr
    own = gpt2("generate", "Return", "-n", "6", "--temperature", "0", "--lora", str(tmp_path / "ad"))
    assert own.returncode == 0, own.stderr
    assert own.stderr.splitlines()[0] == f"gpt2 generate: --lora {tmp_path / 'ad'}: on the base it records, " \
                                         f"{trained_dir.resolve()}"
    with_adapter = GPT2.from_pretrained(trained_dir, lora=tmp_path / "ad")
    assert own.stdout == with_adapter.generate("Return", max_new_tokens=6, temperature=0) + "\n"
    served = gpt2("serve", "--weights", str(other), "--port", "0", "--lora", f"task={tmp_path / 'ad'}")
    assert served.returncode == 2 and served.stderr.count("\n") == 1 and "trained on another base" in served.stderr
