"""llm.c's token shards: `gpt2 tokenize` writes them (llm.c's header and uint16 tokens, each document opened with
<|endoftext|> as its data scripts do; resumable), `gpt2 score` and `gpt2 finetune` read them memory-mapped."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import cli
from test_finetune import corpus

import gpt2_engine.commands.tokenize as tokenize_command
from gpt2_engine import GPT2
from gpt2_engine.formats.shards import ShardError, TokenStream, read_shard, write_shard
from gpt2_engine.train import trainer as trainer_module


def llmc_read(path: Path) -> np.ndarray:
    """A shard read as llm.c's train_gpt2.py _load_data_shard reads it: header magic, version 1, token count."""
    with open(path, "rb") as f:
        header = np.frombuffer(f.read(256 * 4), dtype=np.int32)
        assert header[0] == 20240520 and header[1] == 1
        tokens = np.frombuffer(f.read(), dtype=np.uint16)
    assert len(tokens) == header[2]
    return tokens


def texts(data: Path) -> list[str]:
    return [json.loads(line)["text"] for line in data.read_text().splitlines()]


def test_tokenize_writes_llmc_shards_of_whole_documents(trained_model: GPT2, tmp_path: Path) -> None:
    data = corpus(tmp_path)
    code, err = cli("tokenize", str(data), "--out", str(tmp_path / "out"), "--shard-tokens", "400", "--workers", "2")
    assert code == 0, err
    shards = sorted((tmp_path / "out").glob("shard_*.bin"))
    assert len(shards) > 3
    stream = np.concatenate([llmc_read(p) for p in shards])
    eot, tok = trained_model.tokenizer.eot_id, trained_model.tokenizer
    want = np.concatenate([[eot, *tok.encode(t)] for t in texts(data)]).astype(np.uint16)
    assert np.array_equal(stream, want)
    for p in shards:  # every shard opens with a document and holds whole ones
        tokens = llmc_read(p)
        assert tokens[0] == eot and (len(tokens) <= 400 or (tokens == eot).sum() == 1)
    assert np.array_equal(read_shard(shards[0]), llmc_read(shards[0]))
    state = json.loads((tmp_path / "out" / "tokenize.json").read_text())
    assert state["documents"] == 40 and state["tokens"] == len(want) and state["done"]


def test_a_killed_tokenize_resumes_to_the_same_shards(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = corpus(tmp_path)
    tokenize_command.tokenize_corpus([str(data)], tmp_path / "whole", 300, progress=False)
    written = []
    real = tokenize_command.write_shard

    def dies_after_two(path, tokens):
        if len(written) == 2:
            raise KeyboardInterrupt
        written.append(path)
        real(path, tokens)

    monkeypatch.setattr(tokenize_command, "write_shard", dies_after_two)
    with pytest.raises(KeyboardInterrupt):
        tokenize_command.tokenize_corpus([str(data)], tmp_path / "killed", 300, progress=False)
    monkeypatch.setattr(tokenize_command, "write_shard", real)
    assert json.loads((tmp_path / "killed" / "tokenize.json").read_text())["shards"] == 2
    tokenize_command.tokenize_corpus([str(data)], tmp_path / "killed", 300, progress=False)
    names = sorted(p.name for p in (tmp_path / "whole").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "killed").iterdir())
    for name in names:
        if name.endswith(".bin"):
            assert (tmp_path / "whole" / name).read_bytes() == (tmp_path / "killed" / name).read_bytes()
    code, err = cli("tokenize", str(data), "--out", str(tmp_path / "whole"), "--shard-tokens", "500")
    assert code == 2 and "holds shards of other inputs or settings" in err


def test_gpt2_score_reads_shards_as_the_documents_they_hold(trained_dir: Path, tmp_path: Path, capsys) -> None:
    data = corpus(tmp_path, n=6)
    for i, t in enumerate(texts(data)):
        (tmp_path / f"doc{i}.txt").write_text(t, encoding="utf-8")
    assert cli("tokenize", str(data), "--out", str(tmp_path / "shards"), "--shard-tokens", "120")[0] == 0
    capsys.readouterr()
    assert cli("score", str(tmp_path / "shards"), "--weights", str(trained_dir), "--json")[0] == 0
    from_shards = json.loads(capsys.readouterr().out)
    assert cli("score", *[str(tmp_path / f"doc{i}.txt") for i in range(6)], "--weights", str(trained_dir),
               "--json")[0] == 0
    from_text = json.loads(capsys.readouterr().out)
    assert len(from_shards["documents"]) == 6
    for a, b in zip(from_shards["documents"], from_text["documents"]):  # <|endoftext|> opens each, as bos would
        assert (a["tokens"], a["bytes"]) == (b["tokens"], b["bytes"]) and abs(a["nll"] - b["nll"]) <= 1e-3


def test_gpt2_finetune_trains_on_shards_and_resumes_exactly(trained_dir: Path, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    data = corpus(tmp_path, n=60)
    assert cli("tokenize", str(data), "--out", str(tmp_path / "shards"), "--shard-tokens", "500")[0] == 0
    args = ["--weights", str(trained_dir), "--context", "32", "--batch-size", "2", "--steps", "6",
            "--save-every", "3", "--eval-every", "3", "--lr", "1e-3"]
    code, err = cli("finetune", str(tmp_path / "shards"), "--out", str(tmp_path / "whole"), *args)
    assert code == 0, err
    real_run = trainer_module.Trainer.run

    def dies_at_step_5(self):
        for event in real_run(self):
            yield event
            if getattr(event, "step", 0) == 5 and type(event).__name__ == "Step":
                raise KeyboardInterrupt

    monkeypatch.setattr(trainer_module.Trainer, "run", dies_at_step_5)
    code, err = cli("finetune", str(tmp_path / "shards"), "--out", str(tmp_path / "part"), *args)
    assert code == 130 and err.endswith("gpt2 finetune: interrupted\n")
    monkeypatch.setattr(trainer_module.Trainer, "run", real_run)
    code, err = cli("finetune", str(tmp_path / "shards"), "--out", str(tmp_path / "part"), *args, "--resume")
    assert code == 0, err
    whole, part = (tmp_path / "whole" / "last" / "model.safetensors"), (tmp_path / "part" / "last" / "model.safetensors")
    assert whole.read_bytes() == part.read_bytes()
    stream = TokenStream.of(sorted((tmp_path / "shards").glob("*.bin")))
    assert len(stream) == sum(len(read_shard(p)) for p in sorted((tmp_path / "shards").glob("*.bin")))
    assert stream[490:520].tolist() == np.concatenate([read_shard(p) for p in
                                                       sorted((tmp_path / "shards").glob("*.bin"))])[490:520].tolist()


def test_shard_errors_name_the_file(tmp_path: Path) -> None:
    write_shard(tmp_path / "a.bin", np.arange(10))
    (tmp_path / "short.bin").write_bytes((tmp_path / "a.bin").read_bytes()[:-2])
    with pytest.raises(ShardError, match=r"short.bin: the header says 10 tokens, the file holds 9 \(truncated\)"):
        read_shard(tmp_path / "short.bin")
    with pytest.raises(ShardError, match="token ids must fit uint16"):
        write_shard(tmp_path / "b.bin", np.array([70000]))
    (tmp_path / "t.txt").write_text("text", encoding="utf-8")
    code, err = cli("score", str(tmp_path / "a.bin"), str(tmp_path / "t.txt"), "--weights", "x")
    assert code == 2 and "give either token shards (llm.c's .bin) or text files, not both" in err


def test_a_failed_tokenize_prints_one_line_and_no_progress_bar(tmp_path: Path) -> None:
    """Progress bars are drawn on a terminal only: a log or a pipe gets the error line alone, not a bar's first frame
    before it (stderr here is a StringIO, as it is a file or pipe under a job runner)."""
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n{bad\n', encoding="utf-8")
    code, err = cli("tokenize", str(tmp_path / "bad.jsonl"), "--out", str(tmp_path / "out"))
    assert (code, err) == (2, f"gpt2 tokenize: error: {tmp_path / 'bad.jsonl'}:2: not valid JSON (Expecting property "
                              "name enclosed in double quotes); expected one JSON object per line\n")
