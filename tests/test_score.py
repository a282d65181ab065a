"""Scoring: the window plan, parity with transformers on the same windows, `gpt2 score` and its errors."""

from __future__ import annotations

import argparse
import io
import json
import math
import sys
from pathlib import Path

import pytest
import torch

from gpt2_engine import GPT2, GPT2EngineError
from gpt2_engine.cli import main
from gpt2_engine.runtime.scoring import ScoreSettings, Window, score_documents, windows

EOT = 50256
# Docstring prose of the kind the trained checkpoint learned from (argparse's is in its corpus, json's is not), and code.
PROSE = (argparse.__doc__ or "") + " " + (json.__doc__ or "")
CODE = Path(__file__).read_text(encoding="utf-8")[:3000]


# --- the window plan ----------------------------------------------------------------------------------------------


def test_windows_follow_the_stated_plan() -> None:
    assert windows(10, 4, 2) == [Window(0, 4, 1), Window(2, 6, 4), Window(4, 8, 6), Window(6, 10, 8)]
    assert windows(10, 4, 3) == [Window(0, 4, 1), Window(3, 7, 4), Window(6, 10, 7)]
    assert windows(3, 8, 4) == [Window(0, 3, 1)]  # shorter than one window
    assert windows(1, 8, 4) == [] and windows(0, 8, 4) == []  # nothing to predict


@pytest.mark.parametrize("n,context,stride", [(2, 2, 1), (100, 16, 15), (100, 16, 1), (1000, 64, 7), (513, 512, 256)])
def test_every_position_after_the_first_is_scored_once(n: int, context: int, stride: int) -> None:
    scored = []
    for w in windows(n, context, stride):
        assert 0 <= w.begin < w.first <= w.end <= n and w.end - w.begin <= context
        assert w.first - w.begin >= min(context - stride, w.first)  # the promised context outside the first window
        scored += range(w.first, w.end)
    assert scored == list(range(1, n))


@pytest.mark.parametrize("stride", [0, 8, 9])
def test_stride_must_be_below_the_context(stride: int) -> None:
    with pytest.raises(ValueError, match=r"stride must be in 1\.\.context-1 = 1\.\.7, got"):
        windows(100, 8, stride)


# --- parity with transformers -------------------------------------------------------------------------------------


def reference_logprobs(hf, ids: list[int], context: int, stride: int, bos: bool = True) -> torch.Tensor:
    """transformers' log-probabilities of every scored token, written from the issue's plan, one window at a time."""
    seq = [EOT, *ids] if bos else list(ids)
    out, prev_end = [], 1  # position 0 is never scored
    end = min(context, len(seq))
    while True:
        begin = max(0, end - context)
        with torch.no_grad():
            # log-softmax in float64 over transformers' float32 logits: torch's float32 log_softmax over 50,257
            # logits is itself off by up to ~1e-4 (measured on the trained checkpoint; float64: 4e-6 from the engine)
            logp = torch.log_softmax(hf(torch.tensor([seq[begin:end]])).logits[0].double(), -1)  # [L, V]
        for p in range(prev_end, end):
            out.append(logp[p - begin - 1, seq[p]])
        if end == len(seq):
            return torch.stack(out) if out else torch.zeros(0)
        prev_end, end = end, min(end + stride, len(seq))


def engine_scores(model: GPT2, texts: list[str], context: int, stride: int, *, bos: bool = True, batch_size: int = 8):
    docs = [(f"d{i}", model.tokenizer.encode(t), len(t.encode())) for i, t in enumerate(texts)]
    settings = ScoreSettings(context, stride, bos=bos, batch_size=batch_size, details=True, top=5)
    return list(score_documents(model.weights, model.config, EOT, docs, settings))


def check_parity(model: GPT2, hf, texts: list[str], context: int, stride: int, bos: bool = True) -> None:
    for text, s in zip(texts, engine_scores(model, texts, context, stride, bos=bos)):
        ref = reference_logprobs(hf, model.tokenizer.encode(text), context, stride, bos)
        assert s.tokens == len(ref) == len(model.tokenizer.encode(text)) - (0 if bos else 1)
        assert (s.stats.logprob - ref).abs().max().item() <= 1e-4  # per-token logprobs, absolute
        assert s.nll == pytest.approx(-ref.double().sum().item(), rel=1e-5)


@pytest.mark.parametrize("context,stride", [(256, 255), (128, 16), (512, 256)])
def test_trained_checkpoint_nll_equals_transformers(trained_model: GPT2, trained_hf_model, context: int, stride: int) -> None:
    check_parity(trained_model, trained_hf_model, [PROSE[:2500], CODE[:1200], "Return the value."], context, stride)


def test_more_than_ten_windows_and_no_bos(trained_model: GPT2, trained_hf_model) -> None:
    text = PROSE[:1500]
    assert len(windows(len(trained_model.tokenizer.encode(text)) + 1, 48, 24)) > 10
    check_parity(trained_model, trained_hf_model, [text], 48, 24)
    check_parity(trained_model, trained_hf_model, [text], 48, 24, bos=False)


@pytest.mark.slow
@pytest.mark.long
def test_full_size_fixture_nll_equals_transformers(model: GPT2, hf_model) -> None:
    check_parity(model, hf_model, [PROSE[:3000], "Hi", "x"], 1024, 512)  # ~700 tokens in one window, short ones
    check_parity(model, hf_model, [PROSE[:1200]], 128, 100)


def test_one_token_document(trained_model: GPT2, trained_hf_model) -> None:
    [s] = engine_scores(trained_model, ["The"], 512, 256)
    ref = reference_logprobs(trained_hf_model, trained_model.tokenizer.encode("The"), 512, 256)
    assert s.tokens == 1 and s.nll == pytest.approx(-ref.item(), rel=1e-5)
    [s] = engine_scores(trained_model, ["The"], 512, 256, bos=False)
    assert s.tokens == 0 and s.nll == 0.0 and math.isnan(s.ppl)


def test_batches_that_mix_lengths_give_the_numbers_of_one_at_a_time(trained_model: GPT2) -> None:
    texts = [PROSE[:3000], "Short one.", CODE[:800], "x", PROSE[500:900]]
    together = engine_scores(trained_model, texts, 256, 128, batch_size=8)
    alone = [engine_scores(trained_model, [t], 256, 128, batch_size=1)[0] for t in texts]
    for a, b in zip(together, alone):
        assert a.tokens == b.tokens
        assert a.nll == pytest.approx(b.nll, rel=1e-6, abs=1e-6)
        assert (a.stats.logprob - b.stats.logprob).abs().max().item() <= 1e-5
        assert torch.equal(a.stats.rank, b.stats.rank)


def test_per_token_details_agree_with_the_full_distribution(trained_model: GPT2) -> None:
    [s] = engine_scores(trained_model, ["The value of the argument is returned."], 512, 256)
    ids = torch.tensor([[EOT, *s.token_ids]])
    logp = torch.log_softmax(trained_model(ids)[0, :-1].double(), -1)  # [T, V], exact enough to be the reference
    chosen = logp.gather(-1, ids[0, 1:, None])[:, 0]
    assert torch.equal(s.stats.rank, (logp > chosen[:, None]).sum(-1))
    assert torch.allclose(s.stats.entropy.double(), -(logp.exp() * logp).sum(-1), atol=1e-4)
    assert torch.equal(s.stats.top_ids, logp.topk(5, -1).indices)
    assert torch.allclose(s.stats.top_logprobs.double(), logp.topk(5, -1).values, atol=1e-5)
    assert torch.allclose(s.stats.logprob.double(), logp.gather(-1, ids[0, 1:, None])[:, 0], atol=1e-5)


def test_python_api(trained_model: GPT2, trained_hf_model) -> None:
    [a, b] = trained_model.score(["Return the value.", PROSE[:900]], context=128, stride=64)
    assert a.tokens == len(trained_model.tokenizer.encode("Return the value."))
    assert a.ppl == pytest.approx(math.exp(a.nll / a.tokens)) and a.bpb == pytest.approx(a.nll / math.log(2) / 17)
    ids = torch.tensor([trained_model.tokenizer.encode(PROSE[:200])])
    with torch.no_grad():
        ref = torch.log_softmax(trained_hf_model(ids).logits[0, :-1].double(), -1).gather(-1, ids[0, 1:, None])[:, 0]
    assert (trained_model.token_logprobs(ids)[0] - ref).abs().max().item() <= 1e-4
    with pytest.raises(GPT2EngineError, match="expected a list of strings"):
        trained_model.score("one string")
    with pytest.raises(GPT2EngineError, match="^texts: expected a list of strings, got a dict$"):
        trained_model.score({"a": "hello"})
    with pytest.raises(GPT2EngineError, match="^bos: expected True or False, got 'no'$"):
        trained_model.score(["x y"], bos="no")
    with pytest.raises(GPT2EngineError, match="^context: expected an integer, got 64.5$"):
        trained_model.score(["x y"], context=64.5)


def test_trained_checkpoint_has_learned_its_corpus(trained_model: GPT2) -> None:
    """A plausible model, not noise: held-out docstring prose is far likelier than under a uniform distribution,
    and far likelier than the same words shuffled."""
    words = PROSE[:3000].split()
    shuffled = " ".join(words[i] for i in torch.randperm(len(words), generator=torch.Generator().manual_seed(0)))
    real, mixed = trained_model.score([" ".join(words), shuffled])
    assert real.ppl < 1000 < math.exp(math.log(50257))
    assert real.ppl < 0.5 * mixed.ppl


# --- `gpt2 score` -------------------------------------------------------------------------------------------------


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture()
def corpus(tmp_path: Path) -> Path:
    (tmp_path / "a.txt").write_text(PROSE[:1500], encoding="utf-8")
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "Return the value."}) + "\n\n"
                                      + json.dumps({"text": "Zoë — 東京 🤖", "id": 3}) + "\n", encoding="utf-8")
    return tmp_path


def test_score_json_has_exactly_the_stated_shape(capsys, trained_dir: Path, trained_model: GPT2, corpus: Path) -> None:
    code, out, err = run(capsys, "score", str(corpus / "a.txt"), str(corpus / "b.jsonl"), "--json",
                         "--weights", str(trained_dir), "--context", "256", "--stride", "128")
    assert code == 0 and err == ""  # no progress bar off a terminal
    doc = json.loads(out)
    assert list(doc) == ["documents", "total", "settings"]
    assert [d["name"] for d in doc["documents"]] == [str(corpus / "a.txt"), f"{corpus / 'b.jsonl'}:1", f"{corpus / 'b.jsonl'}:3"]
    assert all(list(d) == ["name", "tokens", "bytes", "nll", "ppl", "bpb"] for d in doc["documents"])
    assert doc["settings"] == {"context": 256, "stride": 128, "bos": True, "dtype": "float32", "quantize": None,
                               "weights": str(trained_dir)}
    api = trained_model.score([PROSE[:1500], "Return the value.", "Zoë — 東京 🤖"], context=256, stride=128)
    for d, s in zip(doc["documents"], api):
        assert (d["tokens"], d["bytes"]) == (s.tokens, s.bytes) and d["nll"] == pytest.approx(s.nll, rel=1e-9)
    total = doc["total"]
    assert total["tokens"] == sum(s.tokens for s in api) and total["bytes"] == sum(s.bytes for s in api)
    assert total["ppl"] == pytest.approx(math.exp(total["nll"] / total["tokens"]))
    assert total["bpb"] == pytest.approx(total["nll"] / math.log(2) / total["bytes"])


def test_score_table_stdin_and_per_token(capsys, monkeypatch, trained_dir: Path, trained_model: GPT2, tmp_path: Path) -> None:
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"Return the value.")))
    out_file = tmp_path / "tok.jsonl"
    code, out, _ = run(capsys, "score", "-", "--weights", str(trained_dir), "--per-token", str(out_file))
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == ["document", "tokens", "bytes", "nll", "ppl", "bpb"]
    assert lines[2].split()[:3] == ["-", "4", "17"] and lines[4].split()[:3] == ["total", "4", "17"]
    assert "tokens scored" in lines[5] and "tokens/s" in lines[5]
    records = [json.loads(line) for line in out_file.read_text().splitlines()]
    ids = trained_model.tokenizer.encode("Return the value.")
    assert [r["token_id"] for r in records] == ids and [r["index"] for r in records] == [0, 1, 2, 3]
    assert [r["token"] for r in records] == ["Return", " the", " value", "."]
    assert set(records[0]) == {"document", "index", "token_id", "token", "logprob", "rank", "entropy", "top"}
    assert len(records[0]["top"]) == 5 and records[0]["document"] == "-"
    expected = trained_model.token_logprobs(torch.tensor([[EOT, *ids]]))[0]
    assert [r["logprob"] for r in records] == pytest.approx(expected.tolist(), abs=1e-5)
    assert all((r["rank"] == 1) == (r["top"][0]["token_id"] == r["token_id"]) for r in records)
    assert not list(tmp_path.glob("*.part"))


def test_score_reads_folders_and_writes_per_token_lines_to_stdout(capsys, trained_dir: Path, trained_model: GPT2,
                                                                  tmp_path: Path) -> None:
    """A folder is the text files under it (as gpt2 finetune reads it); `-` as an output file is stdout, and the
    table then goes to stderr."""
    (tmp_path / "docs" / "sub").mkdir(parents=True)
    (tmp_path / "docs" / "a.txt").write_text("Return the value.")
    (tmp_path / "docs" / "sub" / "b.md").write_text("Raise an error.")
    (tmp_path / "docs" / "skip.bin").write_bytes(b"\xff")
    code, out, err = run(capsys, "score", str(tmp_path / "docs"), "--per-token", "-", "--json",
                         "--weights", str(trained_dir))
    assert code == 0, err
    records = [json.loads(line) for line in out.splitlines()]
    a, b = str(tmp_path / "docs" / "a.txt"), str(tmp_path / "docs" / "sub" / "b.md")
    n = [len(trained_model.tokenizer.encode(text)) for text in ("Return the value.", "Raise an error.")]
    assert [r["document"] for r in records] == [a] * n[0] + [b] * n[1]
    report = json.loads(err.strip().splitlines()[-1])
    assert [d["name"] for d in report["documents"]] == [a, b]
    code, files_out, _ = run(capsys, "score", a, b, "--json", "--weights", str(trained_dir))
    assert json.loads(files_out)["total"] == report["total"]  # the folder scores exactly as its files


@pytest.mark.parametrize("args,message", [
    (["missing.txt"], "missing.txt: no such file"),
    (["{d}/nothing"], "nothing: the folder holds no text files (expected .txt, .md, .rst, .jsonl, .text)"),
    (["{d}/ok.txt", "--per-token", "-", "--output", "-"], "--per-token and --output cannot both be - (stdout)"),
    (["{d}/bad.txt"], "bad.txt: invalid UTF-8 at byte offset 6 (expected UTF-8 text)"),
    (["{d}/bad.jsonl"], 'bad.jsonl:2: expected a JSON object with a string "text" field'),
    (["{d}/broken.jsonl"], "broken.jsonl:1: not valid JSON"),
    (["{d}/empty.txt"], "nothing to score: every document is empty"),
    (["{d}/blank.jsonl"], "nothing to score: the input holds no documents"),
    (["{d}/ok.txt", "--stride", "0"], "stride must be in 1..context-1 = 1..511, got 0"),
    (["{d}/ok.txt", "--context", "64", "--stride", "64"], "stride must be in 1..context-1 = 1..63, got 64"),
    (["{d}/ok.txt", "--context", "513"], "context must be in 2..512 (the model's n_positions), got 513"),
    (["{d}/ok.txt", "--batch-size", "0"], "batch size must be at least 1, got 0"),
])
def test_score_errors_are_one_line_and_exit_2(capsys, tmp_path: Path, trained_dir: Path, args: list[str], message: str) -> None:
    (tmp_path / "bad.txt").write_bytes(b"hello \xff world")
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"body": "no text"}\n')
    (tmp_path / "broken.jsonl").write_text('{"text": \n')
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "blank.jsonl").write_text("\n\n")
    (tmp_path / "ok.txt").write_text("Fine text.")
    (tmp_path / "nothing").mkdir()
    code, out, err = run(capsys, "score", *[a.format(d=tmp_path) for a in args], "--weights", str(trained_dir))
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("gpt2 score: error: ") and message in err, err
