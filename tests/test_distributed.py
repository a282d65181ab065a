"""Scaling out on Ray, on one 2-core machine (ray.init(num_cpus=2)): Ray Data scoring equals local scoring; two
Ray Serve replicas of the same app answer the `openai` client, split the load, and survive one being killed."""

from __future__ import annotations

import concurrent.futures
import json
import re
import logging
import time
from pathlib import Path

import pytest
from conftest import free_port, wait_for

from gpt2_engine import GPT2
from gpt2_engine.cli import build_parser, main
from gpt2_engine.commands.serve import check_options

pytestmark = [pytest.mark.slow, pytest.mark.long]  # make test-fast and make test leave it out

ray = pytest.importorskip("ray", reason="Ray is in the test extra (pip install -e '.[test]')")
serve = pytest.importorskip("ray.serve")

PROMPTS = ["Return a new", "If the value is", "Close the file", "The number of"]


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, logging_level=logging.WARNING, log_to_driver=False)
    yield
    serve.shutdown()
    ray.shutdown()


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_ray_data_scoring_equals_local_scoring(cluster, capsys, trained_dir: Path, tmp_path: Path) -> None:
    lines = [json.dumps({"text": f"Return the {i} bytes of the file object {'and close it ' * (i % 7)}when done."})
             for i in range(195)]
    (tmp_path / "corpus.jsonl").write_text("\n".join(lines) + "\n")
    for i in range(5):
        (tmp_path / f"doc{i}.txt").write_text("If the value is None, raise an error. " * (40 * i + 1))
    files = [str(tmp_path / "doc0.txt"), str(tmp_path / "corpus.jsonl"), *(str(tmp_path / f"doc{i}.txt") for i in range(1, 5))]
    common = ["--weights", str(trained_dir), "--context", "128", "--stride", "64", "--json"]
    code, out, _ = run(capsys, "score", *files, *common)
    assert code == 0
    local = json.loads(out)
    code, out, _ = run(capsys, "score", *files, *common, "--ray", "--workers", "2", "--output", str(tmp_path / "docs.jsonl"))
    assert code == 0
    distributed = json.loads(out)
    per_doc = [json.loads(line) for line in (tmp_path / "docs.jsonl").read_text().splitlines()]
    assert len(per_doc) == len(local["documents"]) == 200
    assert [d["name"] for d in per_doc] == [d["name"] for d in local["documents"]]  # input order
    for ours, theirs in zip(per_doc, local["documents"]):
        assert ours["tokens"] == theirs["tokens"] and ours["bytes"] == theirs["bytes"]
        assert ours["nll"] == pytest.approx(theirs["nll"], rel=1e-6), ours["name"]
    assert distributed["settings"] == local["settings"] and distributed["output"] == str(tmp_path / "docs.jsonl")
    assert distributed["total"]["tokens"] == local["total"]["tokens"]
    assert distributed["total"]["nll"] == pytest.approx(local["total"]["nll"], rel=1e-6)


def test_a_ray_dashboard_equals_the_local_one(cluster, capsys, trained_dir: Path, saes_dir: Path,
                                               tmp_path: Path) -> None:
    """Two actors of one thread take the batches as they come; their parts merge to the local run's dashboard, every
    number and context the same (ties broken by corpus position, as locally). Before the Serve tests, whose replicas
    hold the cluster's CPUs until the module ends."""

    text = tmp_path / "corpus.txt"
    text.write_text("\n\n".join(f"{n}. Return the list of keys; raise KeyError when the key is missing." for n in range(60)))
    common = [str(text), "--sae", str(saes_dir / "jumprelu-resid"), "--features", "0,7,100,1023",
              "--top", "5", "--context", "32", "--batch-size", "2", "--weights", str(trained_dir), "--quiet"]
    code, _, err = run(capsys, "sae", "dashboard", *common, "--out", str(tmp_path / "local"))
    assert code == 0, err
    code, _, err = run(capsys, "sae", "dashboard", *common, "--out", str(tmp_path / "ray"), "--ray", "--workers", "2",
                       "--threads", "1")
    assert code == 0, err
    local = json.loads((tmp_path / "local" / "dashboard.json").read_text())
    spread = json.loads((tmp_path / "ray" / "dashboard.json").read_text())
    assert spread == local and local["windows"] > 10 and local["features"][0]["top"]
    code, _, err = run(capsys, "sae", "dashboard", *common, "--out", str(tmp_path / "big"), "--ray", "--workers", "5",
                       "--threads", "1")
    # the count free is 2 once the actors above are gone; Ray returns a killed actor's CPUs asynchronously
    assert code == 2 and re.search(r"--workers 5 x --threads 1 need 5 CPUs; the Ray cluster has [0-2] free", err), err


@pytest.mark.parametrize("args, message", [
    (["--per-token", "t.jsonl", "--ray"], "--per-token is not available with --ray; use --output"),
    (["--workers", "2"], "--address and --workers need --ray"),
    (["--ray", "--workers", "0"], "--workers must be at least 1, got 0"),
])
def test_score_ray_option_errors(capsys, trained_dir: Path, tmp_path: Path, args: list[str], message: str) -> None:
    (tmp_path / "a.txt").write_text("text")
    code, out, err = run(capsys, "score", str(tmp_path / "a.txt"), *args, "--weights", str(trained_dir))
    assert code == 2 and out == "" and err.startswith(f"gpt2 score: error: {message}") and err.count("\n") == 1, err


@pytest.mark.parametrize("args, message", [
    (["--replicas", "2"], "--replicas, --max-replicas and --address need --ray"),
    (["--ray", "--replicas", "two"], "--replicas: expected a positive number or 'auto', got 'two'"),
    (["--ray", "--replicas", "2", "--max-replicas", "3"], "--max-replicas goes with --replicas auto"),
])
def test_serve_ray_option_errors(capsys, trained_dir: Path, args: list[str], message: str) -> None:
    code, out, err = run(capsys, "serve", *args, "--weights", str(trained_dir))
    assert code == 2 and err == f"gpt2 serve: error: {message}\n", err


@pytest.fixture(scope="module")
def replicas(cluster, trained_dir: Path):
    """The app on 2 Ray Serve replicas of 2 slots each, 8 requests waiting at most, on 127.0.0.1."""
    from gpt2_engine.distributed.serve import APP_NAME, deployment

    port = free_port()
    args = build_parser().parse_args(["serve", "--ray", "--replicas", "2", "--parallel", "2", "--max-queue", "8",
                                      "--weights", str(trained_dir), "--port", str(port)])
    serve.start(http_options={"host": "127.0.0.1", "port": port}, logging_config={"log_level": "WARNING"})
    serve.run(deployment(args, check_options(args)), name=APP_NAME, route_prefix="/")
    yield f"http://127.0.0.1:{port}"
    serve.delete(APP_NAME)


def complete(base: str, prompt: str, retries: int = 0, tokens: int = 12) -> tuple[str, str]:
    """(text, the replica that answered) of a greedy completion through the openai client."""
    import openai

    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=retries, timeout=60)
    raw = client.completions.with_raw_response.create(model="gpt2", prompt=prompt, max_tokens=tokens, temperature=0,
                                                      extra_body={"ignore_eos": True})
    return raw.parse().choices[0].text, raw.headers["x-gpt2-replica"]


def test_two_replicas_answer_the_openai_client_and_split_the_load(replicas: str, trained_model: GPT2) -> None:
    expected = [trained_model.generate(p, max_new_tokens=12, temperature=0, ignore_eos=True) for p in PROMPTS]
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        answers = list(pool.map(lambda p: complete(replicas, p), PROMPTS))
    assert [text for text, _ in answers] == expected  # the same engine, the same greedy tokens
    assert len({replica for _, replica in answers}) == 2, answers  # 4 requests, 2 at a time per replica: both serve


def running_replicas() -> int:
    from gpt2_engine.distributed.serve import APP_NAME

    app = serve.status().applications.get(APP_NAME)
    return 0 if app is None else app.deployments["GPT2Replica"].replica_states.get("RUNNING", 0)


def test_a_killed_replica_costs_no_request_that_the_client_retries_once(replicas: str, trained_model: GPT2) -> None:
    expected = {p: trained_model.generate(p, max_new_tokens=200, temperature=0, ignore_eos=True) for p in PROMPTS}
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if "GPT2Replica" in a["name"]]
    assert len(names) == 2 and running_replicas() == 2, names
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(complete, replicas, p, 1, 200) for p in PROMPTS * 2]  # ~1 s each, 2 at a time per replica
        time.sleep(0.3)  # let requests reach the replicas (not a timing assertion: any moment works)
        ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=True)
        results = [f.result() for f in futures]
    assert [text for text, _ in results] == [expected[p] for p in PROMPTS * 2]
    wait_for(lambda: running_replicas() == 2, "Ray Serve to replace the killed replica", seconds=60)
