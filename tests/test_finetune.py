"""`gpt2 finetune` and the trainer under it: AdamW against torch's, the data windows, checkpoints transformers loads,
exact resume after kill -9, and every bad input's one line."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_training import TINY, hf_model, random_batch, tiny_weights

from gpt2_engine import GPT2
from gpt2_engine.cli import main
from gpt2_engine.formats.files import umask as current_umask
from gpt2_engine.core.kernels import training_kernels
from gpt2_engine.core.weights import named_tensors
from gpt2_engine.train.optim import AdamW, AdamWSettings, adamw_reference, clip_factor, learning_rate
from gpt2_engine.train.step import Buffers, decayed, forward_loss, zero_, zeros_like
from gpt2_engine.train.trainer import eval_batches, split_validation, window_order

RUN_TIMEOUT = 300  # seconds for one CLI training run of a few updates


def corpus(directory: Path, n: int = 40) -> Path:
    """A small corpus of distinct docstring-like documents as a .jsonl file."""
    words = "return the value of a list or dict given as input and raise an error when it is missing".split()
    lines = []
    for i in range(n):
        text = " ".join(words[(i * 7 + j * 3) % len(words)] for j in range(30 + i % 11)).capitalize() + "."
        lines.append(json.dumps({"text": text}))
    path = directory / "corpus.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def finetune(*args: str) -> subprocess.CompletedProcess:
    """`gpt2 finetune ARGS` run in this process (the CLI's main, its exit code and stderr)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(["finetune", *args])
    return subprocess.CompletedProcess(args, code, "", err.getvalue())


def small_run(trained_dir: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return [str(data), "--weights", str(trained_dir), "--out", str(out), "--context", "32", "--batch-size", "2",
            "--threads", "2", *extra]


def logged(path: Path, event: str) -> list[dict]:
    return [r for r in map(json.loads, path.read_text().splitlines()) if r["event"] == event]


# --- the optimizer ------------------------------------------------------------------------------------------------

@pytest.mark.skipif(training_kernels() is None, reason="the native kernels could not be built here")
def test_native_adamw_matches_its_reference() -> None:
    g = torch.Generator().manual_seed(0)
    p, grad, m, v = (torch.randn(10_007, generator=g) for _ in range(4))
    v.abs_()
    ref = [t.clone() for t in (p, grad, m, v)]
    args = (3e-3, 0.9, 0.95, 1e-8, 0.1, 1 - 0.9**3, 1 - 0.95**3, 0.7)
    training_kernels().adamw(p, grad, m, v, *args)
    adamw_reference(*ref, *args)
    for name, mine, theirs in zip("pgmv", (p, grad, m, v), ref):
        assert torch.allclose(mine, theirs, rtol=1e-6, atol=1e-7), name


def test_ten_adamw_steps_match_torch_driving_transformers() -> None:
    """Ten updates (clipping that binds, weight decay on the 2-D matrices only, warmup then cosine) of the engine's
    step against torch.optim.AdamW on transformers' model with the same batches.

    In float64: the key bias's gradient is zero in exact arithmetic (it adds one constant to a softmax row), so both
    sides compute rounding noise there, and Adam divides that noise by its own size. In float32 the noise (~1e-9)
    is near eps (1e-8) and the two sides' updates of those 16 entries differ by up to lr; in float64 it is far below
    eps and they vanish. The float32 native update is compared with its torch reference above."""
    w = tiny_weights(5, torch.float64)
    model = hf_model(w, TINY, torch.float64, 0.0)
    B, T, steps, lr0, clip = 3, 16, 10, 3e-3, 0.5
    names = named_tensors(w)
    decay = {n for n in names if decayed(n)}
    settings = AdamWSettings(weight_decay=0.1)
    opt = AdamW(names, decay, settings)
    hf_params = dict((k.removeprefix("transformer."), p) for k, p in model.named_parameters())
    ref = torch.optim.AdamW([{"params": [hf_params[n] for n in names if n in decay], "weight_decay": 0.1},
                             {"params": [hf_params[n] for n in names if n not in decay], "weight_decay": 0.0}],
                            lr=lr0, betas=(settings.beta1, settings.beta2), eps=settings.eps)
    grads = zeros_like(w, TINY)
    buf = Buffers.allocate(TINY, B, T, dtype=torch.float64)
    clipped = 0
    for step in range(steps):
        ids, targets = random_batch(TINY, B, T, seed=100 + step)
        lr = learning_rate(step, steps, lr0, lr0 / 10, 3)
        zero_(grads)
        forward_loss(w, TINY, buf, ids, targets, grads=grads, grad_scale=1 / (B * T))
        norm, factor = clip_factor(named_tensors(grads), clip)
        clipped += factor < 1
        opt.step(named_tensors(grads), lr, factor)

        logits = model(ids).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, TINY.vocab_size), targets.reshape(-1))
        ref.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        for group in ref.param_groups:
            group["lr"] = lr
        ref.step()
    assert clipped > 0, "the test should exercise clipping"
    for name, p in names.items():
        r = hf_params[name].detach()
        err = (p - r).abs().max().item()
        assert err <= 1e-5 * r.abs().max().item(), f"{name}: max |diff| {err:.3g} after {steps} steps"


def test_learning_rate_schedule() -> None:
    rates = [learning_rate(s, 10, 1.0, 0.1, 2) for s in range(10)]
    assert rates[:2] == [0.5, 1.0]  # linear warmup
    assert rates[2] == pytest.approx(1.0) and rates[-1] == pytest.approx(0.1)  # cosine from lr down to min_lr
    assert all(a >= b for a, b in zip(rates[1:], rates[2:]))


# --- data ---------------------------------------------------------------------------------------------------------

def test_validation_split_and_windows() -> None:
    docs = [f"doc {i}" for i in range(40)]
    train, val = split_validation(docs, 0.05)
    assert val == ["doc 19", "doc 39"] and len(train) == 38
    train, val = split_validation(["one two three four five six seven eight nine ten"], 0.2)
    assert train == ["one two three four five six seven "] and val == ["eight nine ten"]  # at a space
    assert torch.equal(window_order(10, 3, 1), window_order(10, 3, 1))
    assert not torch.equal(window_order(10, 3, 1), window_order(10, 3, 2))
    assert sorted(window_order(10, 3, 1).tolist()) == list(range(10))
    stream = torch.arange(23)
    batches = list(eval_batches(stream, 5, 2, pad=-7))
    scored = torch.cat([t[t >= 0] for _, t in batches])
    assert scored.tolist() == list(range(1, 23))  # every token after the first scored exactly once


# --- the command --------------------------------------------------------------------------------------------------

def test_finetune_lowers_validation_loss_and_writes_a_checkpoint_transformers_loads(trained_dir: Path,
                                                                                   tmp_path: Path) -> None:
    from transformers import GPT2LMHeadModel

    out, log = tmp_path / "out", tmp_path / "log.jsonl"
    done = finetune(*small_run(trained_dir, corpus(tmp_path), out, "--steps", "8", "--eval-every", "4", "--lr",
                               "1e-3", "--sample-every", "8", "--sample-prompt", "Return", "--log", str(log)))
    assert done.returncode == 0, done.stderr
    evals = logged(log, "eval")
    assert [e["step"] for e in evals] == [0, 4, 8]
    assert evals[-1]["val_loss"] < evals[0]["val_loss"] - 0.5, evals
    assert "best validation loss" in done.stderr.splitlines()[-1] and str(out) in done.stderr.splitlines()[-1]
    assert len(logged(log, "sample")) == 1 and len(logged(log, "step")) == 8
    plain = 0o666 & ~current_umask()  # what any file the user writes gets, not a temporary file's 0600
    for name in ("config.json", "model.safetensors", "vocab.json", "merges.txt", "generation_config.json"):
        assert (out / name).is_file() and (out / "last" / name).is_file()
        assert stat.S_IMODE((out / name).stat().st_mode) == plain, name

    engine = GPT2.from_pretrained(out)
    reference = GPT2LMHeadModel.from_pretrained(out).eval()
    ids = torch.tensor([engine.tokenizer.encode("Return the value of a list given as input.")])
    with torch.no_grad():
        ref = reference(ids).logits
    got = engine(ids)
    assert (got - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()
    assert min(evals, key=lambda e: e["val_loss"])["step"] == 8  # the top of out/ is the best: the last here


@pytest.mark.slow
@pytest.mark.long
def test_resume_after_kill_reproduces_the_uninterrupted_losses(trained_dir: Path, tmp_path: Path) -> None:
    data = corpus(tmp_path)
    args = ("--steps", "14", "--save-every", "3", "--eval-every", "7", "--dropout", "0.1", "--lr", "1e-3")
    whole = subprocess.run([sys.executable, "-m", "gpt2_engine", "finetune", *small_run(
        trained_dir, data, tmp_path / "whole", *args, "--log", str(tmp_path / "whole.jsonl"))],
        capture_output=True, text=True, timeout=RUN_TIMEOUT)
    assert whole.returncode == 0, whole.stderr

    out, log = tmp_path / "killed", tmp_path / "killed.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "gpt2_engine", "finetune",
                             *small_run(trained_dir, data, out, *args, "--log", str(log))],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + RUN_TIMEOUT
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if log.exists() and any(r["step"] >= 8 for r in logged(log, "step")):
                break
            time.sleep(0.05)
        assert proc.poll() is None, "the run ended before it could be killed"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    assert (out / "last" / "trainer_state.json").is_file()
    resumed = subprocess.run([sys.executable, "-m", "gpt2_engine", "finetune",
                              *small_run(trained_dir, data, out, *args, "--log", str(log), "--resume")],
                             capture_output=True, text=True, timeout=RUN_TIMEOUT)
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming at update 6" in resumed.stderr

    def losses(path: Path) -> dict[int, float]:
        return {r["step"]: r["loss"] for r in logged(path, "step")}  # a step logged twice: the resumed run's

    assert losses(log) == losses(tmp_path / "whole.jsonl")
    assert len(losses(log)) == 14
    assert (out / "model.safetensors").read_bytes() == (tmp_path / "whole" / "model.safetensors").read_bytes()


def test_resume_refuses_other_settings_and_out_refuses_a_second_run(trained_dir: Path, tmp_path: Path) -> None:
    data, out = corpus(tmp_path), tmp_path / "out"
    assert finetune(*small_run(trained_dir, data, out, "--steps", "2")).returncode == 0
    again = finetune(*small_run(trained_dir, data, out, "--steps", "2"))
    assert again.returncode == 2
    assert again.stderr.strip().splitlines() == [
        f"gpt2 finetune: error: {out}: already holds a model (config.json, last, model.safetensors); pass --resume "
        "to continue its run or --overwrite to replace it"]
    other = finetune(*small_run(trained_dir, data, out, "--steps", "2", "--lr", "3e-4", "--resume"))
    assert other.returncode == 2
    assert other.stderr.strip().splitlines() == [
        f"gpt2 finetune: error: --resume: lr is 0.0003 but the run in {out / 'last'} used 0.0001"]
    assert finetune(*small_run(trained_dir, data, out, "--steps", "2", "--overwrite")).returncode == 0
    mine = finetune(*small_run(out, data, out, "--steps", "2", "--overwrite"))  # --weights is the run being replaced
    assert (mine.returncode, mine.stderr.strip().splitlines()) == (2, [
        f"gpt2 finetune: error: --out {out}: holds the --weights checkpoint {out} the run starts from; write the run "
        "somewhere else"])


@pytest.mark.parametrize("case, extra, message", [
    ("empty", (), "no training text: every document is empty"),
    ("short", (), "the training text is 6 tokens, shorter than one window of 33; lower --context or add text"),
    ("ok", ("--context", "4096"), "context: 4096 tokens exceed the model's n_positions 512"),
    ("ok", ("--resume",), "nothing to resume (no last/trainer_state.json); run without --resume to start"),
    ("ok", ("--lr", "1e30", "--steps", "3", "--clip", "0"), "the validation loss became nan at step 1; training stopped"),
    ("ok", ("--init", "huge"), "--init: 'huge' is neither small|medium|large|xl"),
    ("ok", ("--sample-every", "1", "--sample-tokens", "100000"),
     "sample_tokens: 100000 tokens exceed the model's n_positions 512"),  # before training, not at the first sample
    ("missing", (), "no such file"),
])
def test_bad_input_is_one_line_and_exit_2(trained_dir: Path, tmp_path: Path, case: str, extra: tuple[str, ...],
                                          message: str) -> None:
    data = {"empty": tmp_path / "empty.txt", "short": tmp_path / "short.txt", "ok": corpus(tmp_path),
            "missing": tmp_path / "nope.txt"}[case]
    if case == "empty":
        data.write_text("   \n")
    elif case == "short":
        data.write_text("Return the value of it.")
    done = finetune(*small_run(trained_dir, data, tmp_path / "out", "--steps", "2", *extra))
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("gpt2 finetune: error:")]
    assert len(lines) == 1 and message in lines[0], done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("case", ["fifo", "file", "loop", "state-loop", "dangling"])
def test_resume_names_what_is_there_instead_of_a_state(trained_dir: Path, tmp_path: Path, case: str) -> None:
    """--resume where last/trainer_state.json is a FIFO, `last` a file or a symlink loop said "nothing to resume (no
    last/trainer_state.json)", as if the run had never saved: what is there is named."""
    out = tmp_path / "out"
    out.mkdir()
    last, state = out / "last", out / "last" / "trainer_state.json"
    if case == "fifo":
        last.mkdir()
        os.mkfifo(state)  # opening it waits for a writer: the check must not
    elif case == "state-loop":
        last.mkdir()
        os.symlink(state.name, state)
    elif case == "file":
        last.write_text("{}")
    else:
        os.symlink("last" if case == "loop" else "gone", last)
    said = {"fifo": f"{state} is a FIFO, not a regular file", "file": f"{last} is a regular file, not a directory",
            "loop": f"{last} is a symlink loop", "state-loop": f"{state} is a symlink loop",
            "dangling": f"{last} is a link to gone, which does not exist"}[case]
    done = finetune(*small_run(trained_dir, corpus(tmp_path), out, "--steps", "2", "--resume"))
    assert (done.returncode, done.stderr.strip()) == (2, f"gpt2 finetune: error: {out}: cannot resume: {said}")


@pytest.mark.parametrize("lora", [False, True])
def test_resume_names_a_fifo_as_the_optimizer_state(trained_dir: Path, tmp_path: Path, lora: bool) -> None:
    """The thirteenth attack: a FIFO at last/optimizer.safetensors blocked --resume for ever (safetensors' open waits
    for a writer, and retries past SIGTERM and SIGINT), full and LoRA runs alike; it is named as the model file's is."""
    out, data = tmp_path / "out", corpus(tmp_path)
    extra = ("--lora", "4") if lora else ()
    assert finetune(*small_run(trained_dir, data, out, "--steps", "2", *extra)).returncode == 0
    moments = out / "last" / "optimizer.safetensors"
    moments.unlink()
    os.mkfifo(moments)
    done = finetune(*small_run(trained_dir, data, out, "--steps", "2", "--resume", *extra))
    assert (done.returncode, done.stderr.strip()) == (2, f"gpt2 finetune: error: {moments}: a FIFO, not a regular "
                                                         f"file (the optimizer state --resume continues from)")


def test_a_batch_that_cannot_fit_is_refused_with_the_numbers(trained_dir: Path, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A micro-batch whose step cannot fit in memory is one line, before anything is allocated: what it needs, what
    the machine has, and the largest --batch-size that fits (which does fit, and one more does not)."""
    from gpt2_engine.core.config import GPT2Config
    from gpt2_engine.train import trainer

    data = corpus(tmp_path)
    done = finetune(*small_run(trained_dir, data, tmp_path / "out", "--batch-size", "1000000", "--context", "512"))
    assert done.returncode == 2 and "Traceback" not in done.stderr
    [line] = done.stderr.splitlines()
    assert re.fullmatch(r"gpt2 finetune: error: --batch-size 1000000 x --context 512 needs ~[\d,]+\.\d GB for a "
                        r"step's activations, gradients and optimizer state; this machine has [\d.]+ GB available: at "
                        r"most --batch-size \d+ fits \(--accumulate makes larger updates of smaller micro-batches; "
                        r"--recompute keeps fewer activations\)", line), line

    monkeypatch.setattr(trainer, "available_memory", lambda: 4 * 10**9)
    done = finetune(*small_run(trained_dir, data, tmp_path / "out", "--batch-size", "1000", "--context", "512"))
    assert done.returncode == 2 and "this machine has 4.0 GB available" in done.stderr
    fits = int(re.search(r"at most --batch-size (\d+) fits", done.stderr)[1])
    config, settings = GPT2Config.from_json(trained_dir / "config.json"), trainer.TrainSettings(context=512)
    assert 0 < fits < 1000
    assert trainer.step_bytes(config, settings, fits, None, False) <= 4 * 10**9
    assert trainer.step_bytes(config, settings, fits + 1, None, False) > 4 * 10**9


def test_running_out_of_memory_in_a_step_is_one_line(trained_dir: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's allocator failing inside an update is the user's batch being too large for the machine: one line and
    exit 2 (what else fails there is a bug: an internal error, exit 1)."""
    from gpt2_engine.train import trainer

    def fails(message: str):
        def forward_loss(*args, **kwargs):
            raise RuntimeError(message)
        return forward_loss

    oom = ("[enforce fail at alloc_cpu.cpp:118] data. DefaultCPUAllocator: not enough memory: you tried to allocate "
           "262144000000 bytes.")
    args = small_run(trained_dir, corpus(tmp_path), tmp_path / "out", "--steps", "2", "--val-fraction", "0")
    monkeypatch.setattr(trainer, "forward_loss", fails(oom))
    done = finetune(*args)
    assert done.returncode == 2
    assert done.stderr.splitlines()[-1] == (f"gpt2 finetune: error: update 1: out of memory ({oom}); lower --batch-size "
                                            "or --context, or add --recompute")
    monkeypatch.setattr(trainer, "forward_loss", fails("kernel exploded"))
    done = finetune(*args, "--overwrite")
    assert done.returncode == 1
    assert done.stderr.splitlines()[-1].startswith("gpt2 finetune: internal error: RuntimeError: kernel exploded")


def test_python_api_trains_the_model_in_place(trained_dir: Path) -> None:
    model = GPT2.from_pretrained(trained_dir)
    before = model(torch.tensor([[464, 1988]]))
    texts = ["Return the value of the given key, or raise KeyError when it is missing. " * 8] * 6
    result = model.finetune(texts, steps=3, context=32, batch_size=2, lr=1e-3, val_fraction=0.2)
    assert result.steps == 3 and result.tokens == 3 * 2 * 32
    assert [h["event"] for h in result.history][:2] == ["started", "eval"]
    assert result.best_val_loss is not None and result.best_val_loss < result.history[1]["val_loss"]
    assert not torch.equal(model(torch.tensor([[464, 1988]])), before)
    with pytest.raises(Exception, match="expected a list of texts or paths"):
        model.finetune("just one text", steps=1)


def test_the_python_api_reads_numpy_and_torch_numbers_and_refuses_the_rest_before_any_work(
        trained_dir: Path, tmp_path: Path) -> None:
    """The thirteenth attack: lr=np.float32(1e-4) trained, then failed saving its state as JSON with a raw TypeError
    (last.new left behind); strings gave raw TypeErrors, seed=np.int64 one too, np.int64(2) steps were "expected an
    integer >= 1, got np.int64(2)", and lr=True, warmup=0.5 were taken. Numbers are read as generate reads them."""
    import numpy as np

    from gpt2_engine.core.errors import GPT2EngineError
    from gpt2_engine.train.trainer import TrainError, TrainSettings

    read = TrainSettings(lr=np.float32(0.5), clip=torch.tensor(2.0), steps=np.int64(3), seed=torch.tensor(7),
                         warmup=np.int32(0), epochs=None, batch_size=np.uint8(2))
    assert [(type(v), v) for v in (read.lr, read.clip, read.steps, read.seed, read.warmup, read.batch_size)] == [
        (float, 0.5), (float, 2.0), (int, 3), (int, 7), (int, 0), (int, 2)]
    for field, value, said in [("lr", True, "lr: expected a number, got bool True"),
                               ("lr", "0.1", "lr: expected a number, got str '0.1'"),
                               ("warmup", 0.5, "warmup: expected an integer, got float 0.5"),
                               ("sample_every", 0.5, "sample_every: expected an integer, got float 0.5"),
                               ("epochs", "1", "epochs: expected a number, got str '1'"),
                               ("weight_decay", float("nan"), "weight_decay: expected a finite number, got float nan"),
                               ("seed", -1, "seed: expected an integer in [0, 2^63), got -1"),
                               ("beta2", 1.0, "beta2: expected a number in [0, 1), got 1.0"),
                               ("recompute", 1, "recompute: expected True or False, got 1")]:
        with pytest.raises(TrainError, match=f"^{re.escape(said)}$"):
            TrainSettings(**{field: value})
    model, out = GPT2.from_pretrained(trained_dir), tmp_path / "run"
    texts = ["Return the value of the given key, or raise KeyError when it is missing. " * 8] * 6
    with pytest.raises(TrainError, match="^lr: expected a number, got str '0.1'$"):
        model.finetune(texts, steps=1, context=32, out=out, lr="0.1")
    with pytest.raises(GPT2EngineError, match=r"^finetune: no setting 'bogus'; expected TrainSettings' fields \(context, "):
        model.finetune(texts, steps=1, bogus=1)
    assert not out.exists()
    model.finetune(texts, steps=1, context=32, batch_size=2, out=out, lr=np.float32(1e-4), seed=np.int64(2))
    state = json.loads((out / "last" / "trainer_state.json").read_text())
    assert "last.new" not in os.listdir(out) and state["trajectory"]["settings"]["lr"] == float(np.float32(1e-4))


def test_accumulation_equals_the_larger_batch(trained_model: GPT2) -> None:
    """Two micro-batches of 2 windows make the same update as one batch of 4 (the same windows, in the same order)."""
    texts = [f"Return the value number {i} of the list, or raise an error when it is missing. " * 3 for i in range(12)]
    runs = []
    for batch, accumulate in ((4, 1), (2, 2)):
        model = GPT2(trained_model.config, trained_model.weights, trained_model.tokenizer, dtype=torch.float32,
                     device=torch.device("cpu"))
        result = model.finetune(texts, steps=3, context=32, batch_size=batch, accumulate=accumulate, lr=1e-3,
                                val_fraction=0)
        runs.append([h["loss"] for h in result.history if h["event"] == "step"])
    assert runs[0] == pytest.approx(runs[1], rel=1e-5)


def test_early_stopping_after_patience_evaluations(trained_model: GPT2, monkeypatch: pytest.MonkeyPatch) -> None:
    from gpt2_engine.train.trainer import Trainer

    scripted = iter([5.0, 4.0, 4.5, 4.0, 3.0])  # evaluations at steps 0, 1, 2, 3, (4: never reached)
    monkeypatch.setattr(Trainer, "validation_loss", lambda self: next(scripted))
    model = GPT2(trained_model.config, trained_model.weights, trained_model.tokenizer, dtype=torch.float32,
                 device=torch.device("cpu"))
    texts = ["Return the value of the list, or raise an error when it is missing. " * 6] * 8
    result = model.finetune(texts, steps=10, context=32, batch_size=2, eval_every=1, early_stopping=2)
    stopped = [h for h in result.history if h["event"] == "stopped"]
    assert result.steps == 3 and result.best_val_loss == 4.0 and result.best_step == 1  # 4.0 again is no new best
    assert stopped == [{"event": "stopped", "step": 3,
                        "reason": "early stopping: 2 evaluations without a new best (best 4.0000 at step 1)"}]


def test_a_folder_of_text_trains_from_scratch_with_init(tmp_path: Path) -> None:
    """--init CONFIG.json on a folder (hidden files skipped): GPT-2's initialisation, the packaged BPE, an
    official-layout result that loads, and a folder with no text is one line."""
    folder = tmp_path / "notes"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.txt").write_text("Return the value of the list, or raise an error when it is missing. " * 20)
    (folder / "sub" / "b.md").write_text("Compute the sum of the numbers given as input and return it. " * 20)
    (folder / ".hidden.txt").write_bytes(b"\xff\xfe")  # invalid UTF-8: reading it would fail the run
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps({"n_layer": 1, "n_head": 2, "n_embd": 32, "n_positions": 64}))
    out = tmp_path / "out"
    done = finetune(str(folder), "--init", str(config), "--weights", str(tmp_path / "none"), "--out", str(out),
                    "--steps", "2", "--context", "16", "--batch-size", "2", "--val-fraction", "0")
    assert done.returncode == 0, done.stderr
    assert "no validation data; the last model is saved in" in done.stderr.splitlines()[-1]
    model = GPT2.from_pretrained(out)
    assert model.config.n_layer == 1 and model.config.n_embd == 32
    (tmp_path / "empty").mkdir()
    empty = finetune(str(tmp_path / "empty"), "--init", str(config), "--out", str(tmp_path / "out2"))
    assert empty.returncode == 2
    assert empty.stderr.strip().splitlines() == [
        f"gpt2 finetune: error: {tmp_path / 'empty'}: the folder holds no text files (expected .txt, .md, .rst, "
        ".jsonl, .text)"]


def test_too_little_validation_text_is_warned_about(trained_dir: Path, tmp_path: Path) -> None:
    done = finetune(*small_run(trained_dir, corpus(tmp_path), tmp_path / "out", "--steps", "1"))
    assert done.returncode == 0, done.stderr
    [line] = [s for s in done.stderr.splitlines() if "warning" in s]
    assert line.startswith("gpt2 finetune: warning: only ") and "validation tokens: the best checkpoint would be " \
        "chosen on noise; give --val FILE or a larger --val-fraction (at least 1,000 tokens)" in line
    model = GPT2.from_pretrained(trained_dir)
    with pytest.warns(UserWarning, match="validation tokens: the best checkpoint would be chosen on noise"):
        model.finetune(["Return the value. " * 40, "Raise an error. " * 40], steps=1, val=["Return it."], context=16)


def test_a_diverging_run_keeps_only_finite_checkpoints(trained_dir: Path, tmp_path: Path) -> None:
    """--lr 1e6 blows the weights up: the run stops with one line, and neither the best checkpoint nor last/ holds
    a model whose validation loss is not finite."""
    from safetensors.torch import load_file

    out = tmp_path / "out"
    done = finetune(*small_run(trained_dir, corpus(tmp_path), out, "--steps", "8", "--lr", "1e6", "--warmup", "0",
                               "--eval-every", "1", "--save-every", "1"))
    assert done.returncode == 2
    last_line = done.stderr.strip().splitlines()[-1]
    assert last_line.startswith("gpt2 finetune: error: the ") and "training stopped" in last_line, last_line
    assert "(try a lower --lr)" in last_line
    kept = [d for d in (out, out / "last") if (d / "model.safetensors").is_file()]
    assert kept  # the step-0 evaluation's best, at least
    for directory in kept:  # each loads and gives finite logits (a NaN model generates token 0 forever)
        assert all(torch.isfinite(t).all() for t in load_file(directory / "model.safetensors").values()), directory
        model = GPT2.from_pretrained(directory)
        assert torch.isfinite(model(torch.tensor([model.tokenizer.encode("Return the value")]))).all(), directory
    assert ("the last good checkpoint is in" in last_line) == (out / "last" / "model.safetensors").is_file()
