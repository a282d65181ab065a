"""lm-evaluation-harness as a client: `gpt2 eval` and lm-eval's local-completions against `gpt2 serve` give the
metrics of `lm_eval --model hf` on the same checkpoint (1e-4 relative) and the same generate_until strings, on
local task files (scripts/eval_tasks.py): rolling perplexity, multiple choice (also 5-shot) and generate_until."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import eval_tasks
import pytest
from test_serve import live

from gpt2_engine import GPT2
from gpt2_engine.cli import main

pytestmark = [pytest.mark.slow, pytest.mark.long]  # make test-fast and make test leave it out

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is part of the test extra")

TOL = 1e-4


@pytest.fixture(scope="module")
def tasks(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    d = tmp_path_factory.mktemp("tasks")
    return [str(eval_tasks.rolling(d, docs=4)), str(eval_tasks.choice(d, docs=6)),
            str(eval_tasks.fewshot(d, docs=4, shots=5)), str(eval_tasks.generate(d, docs=5))]


@pytest.fixture(scope="module")
def hf_results(tasks: list[str], trained_dir: Path) -> dict:
    """`lm_eval --model hf` on the trained checkpoint: the reference."""
    return lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={trained_dir},dtype=float32", tasks=tasks,
                                   device="cpu", log_samples=True)


def metrics(results: dict) -> dict[str, float]:
    return {f"{task}/{name}": float(v) for task, values in results["results"].items() for name, v in values.items()
            if "," in name and "stderr" not in name}


def generations(results: dict) -> list[str]:
    return [s["filtered_resps"][0] for s in sorted(results["samples"]["local_generate"], key=lambda s: s["doc_id"])]


def assert_same(results: dict, reference: dict) -> None:
    ours, ref = metrics(results), metrics(reference)
    assert ours.keys() == ref.keys() and len(ref) == 8
    for name, value in ref.items():
        assert math.isclose(ours[name], value, rel_tol=TOL, abs_tol=1e-12), (name, ours[name], value)
    assert generations(results) == generations(reference)
    assert any(generations(reference))  # the task generates text, not only empty strings


def test_gpt2_eval_gives_lm_evals_hf_metrics(tasks: list[str], hf_results: dict, trained_dir: Path,
                                             tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    assert main(["eval", "--tasks", *tasks, "--trust-task-code", "--weights", str(trained_dir), "--output", str(out),
                 "--log-samples"]) == 0
    assert_same(json.loads(out.read_text()), hf_results)


@pytest.mark.parametrize("backend", ["auto", "huggingface"])
def test_local_completions_against_gpt2_serve(backend: str, tasks: list[str], hf_results: dict,
                                              trained_model: GPT2, trained_dir: Path) -> None:
    with live(trained_model, parallel=2, max_queue=8, prefix_cache_mb=64) as (url, engine):
        args = {"base_url": f"{url}/v1/completions", "model": "gpt2", "tokenizer_backend": backend,
                "tokenized_requests": True, "max_length": trained_model.config.n_positions}
        if backend == "huggingface":
            args["tokenizer"] = str(trained_dir)
        results = lm_eval.simple_evaluate(model="local-completions", model_args=args, tasks=tasks, log_samples=True)
        hits = engine.loop.runner.prefix.counters.hit
    assert_same(results, hf_results)
    assert hits > 0  # the choices of a question share their context's blocks


def test_tokenizer_info_and_tokenize_in_lm_evals_shape(trained_model: GPT2) -> None:
    import httpx
    from lm_eval.utils import RemoteTokenizer

    with live(trained_model) as (url, _):
        info = httpx.get(f"{url}/tokenizer_info").json()
        assert info["eos_token"] == "<|endoftext|>" and info["model_max_length"] == trained_model.config.n_positions
        remote = RemoteTokenizer(f"{url}/v1/completions")
        assert remote.eos_token_id == trained_model.tokenizer.eot_id == 50256
        assert remote.encode("Hello world") == trained_model.tokenizer.encode("Hello world")
        assert remote.decode(remote.encode("Hello world")) == "Hello world"


def test_eval_never_writes_its_results_over_what_it_reads(capsys, trained_dir: Path, tmp_path: Path) -> None:
    """--output naming the model's own file replaced a 28 MB checkpoint with 6 KB of JSON (exit 0)."""
    model = tmp_path / "m"
    shutil.copytree(trained_dir, model)
    weights = model / "model.safetensors"
    assert main(["eval", "--weights", str(model), "--tasks", "x", "--output", str(weights)]) == 2
    assert capsys.readouterr().err == (f"gpt2 eval: error: --output {weights}: is {weights}, one of the inputs, which "
                                       "writing would replace; write the results somewhere else\n")


@pytest.mark.parametrize("args, fragment", [
    (["--tasks", "missing.yaml"], "--tasks missing.yaml: no such task file"),
    (["--tasks", "no_such_task_anywhere"], "no_such_task_anywhere"),
    (["--tasks", "x.yaml", "--limit", "0"], "--limit must be a positive count or fraction, got 0.0"),
    (["--tasks", "x.yaml", "--log-samples"], "--log-samples writes the samples into --output FILE"),
    (["--tasks", "x.yaml", "--output", "/tmp"], "/tmp: a directory; expected a file to write"),  # before the run
])
def test_eval_errors_are_one_line(capsys, trained_dir: Path, args: list[str], fragment: str) -> None:
    assert main(["eval", "--weights", str(trained_dir), *args]) == 2
    err = capsys.readouterr().err
    assert fragment in err and err.count("\n") == 1, err


def lls(results: dict, task: str) -> list[float]:
    """Every sample's loglikelihoods (one per choice), in document order."""
    samples = sorted(results["samples"][task], key=lambda s: s["doc_id"])
    return [float(r[0][0]) for s in samples for r in s["resps"]]


def test_gpt2_eval_steer_moves_a_planted_choice_and_equals_lm_evals_steered_model(trained_dir: Path, trained_model: GPT2,
                                                                                  tmp_path: Path) -> None:
    """A task whose right answer is always " yes" over " no"; a steering file in lm-eval's steered-model format adds
    the direction wte[yes] - wte[no] after the last block and clamps a direction of layer 1's MLP output to 0.
    `gpt2 eval --steer FILE` scores every choice as lm-eval's `steered` model (hf_steered.py) does, within 1e-4, and
    the accuracy rises to every document."""
    import torch

    texts = [t for t in eval_tasks.unseen() if len(t.split()) >= 30][:12]
    rows = [{"context": eval_tasks.words(t, 0, 24) + " Is that so? Answer:", "endings": [" yes", " no"], "label": 0}
            for t in texts]
    task = eval_tasks._write(tmp_path, "local_planted", rows, eval_tasks.CHOICE_YAML)
    wte, enc = trained_model.weights.wte, trained_model.tokenizer.encode
    planted = (wte[enc(" yes")[0]] - wte[enc(" no")[0]]).float()
    last = f"h.{trained_model.config.n_layer - 1}"
    steer = tmp_path / "steer.pt"
    torch.save({last: {"steering_vector": planted, "steering_coefficient": 300.0, "action": "add", "bias": None,
                       "head_index": None},
                "h.1.mlp": {"steering_vector": torch.randn(trained_model.config.n_embd,
                                                           generator=torch.Generator().manual_seed(5)),
                            "steering_coefficient": 0.0, "action": "clamp", "bias": None, "head_index": None}}, steer)
    plain_out, steered_out = tmp_path / "plain.json", tmp_path / "steered.json"
    assert main(["eval", "--tasks", str(task), "--trust-task-code", "--weights", str(trained_dir),
                 "--output", str(plain_out),
                 "--log-samples"]) == 0
    assert main(["eval", "--tasks", str(task), "--trust-task-code", "--weights", str(trained_dir),
                 "--output", str(steered_out),
                 "--log-samples", "--steer", str(steer)]) == 0
    plain, steered = json.loads(plain_out.read_text()), json.loads(steered_out.read_text())
    reference = lm_eval.simple_evaluate(model="steered", tasks=[str(task)], device="cpu", log_samples=True,
                                        model_args=f"pretrained={trained_dir},steer_path={steer},dtype=float32")
    ours, ref = lls(steered, "local_planted"), lls(reference, "local_planted")
    assert len(ours) == len(ref) == 2 * len(rows)
    assert all(math.isclose(a, b, rel_tol=TOL, abs_tol=1e-4) for a, b in zip(ours, ref)), (ours, ref)
    acc = lambda r: r["results"]["local_planted"]["acc,none"]  # noqa: E731
    assert acc(steered) == acc(reference) == 1.0 and acc(plain) < 1.0
