"""llm.c's token shards: `gpt2 tokenize` writes them (llm.c's header and uint16 tokens, each document opened with
<|endoftext|> as its data scripts do; resumable), `gpt2 score` and `gpt2 finetune` read them memory-mapped."""

from __future__ import annotations

import json
import os
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


def test_tokenize_batches_by_text_size_too_and_writes_the_same_shards(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The fourteenth attack: 256 documents were encoded together whatever their size, their tokens held as Python
    ints (~40 bytes a token: 2.3 GB for 130 MB of text in 48 files). Batches now stop at BATCH_BYTES of text too;
    the shards are the same bytes whatever the batches."""
    data = corpus(tmp_path)
    tokenize_command.tokenize_corpus([str(data)], tmp_path / "whole", 300, progress=False)
    sizes = []
    real = tokenize_command.batches

    def seen(docs):
        for batch in real(docs):
            sizes.append((len(batch), sum(map(len, batch))))
            yield batch

    monkeypatch.setattr(tokenize_command, "BATCH_BYTES", 500)
    monkeypatch.setattr(tokenize_command, "batches", seen)
    tokenize_command.tokenize_corpus([str(data)], tmp_path / "small", 300, progress=False)
    assert len(sizes) > 3 and all(size <= 500 or count == 1 for count, size in sizes)  # a longer document alone
    for path in (tmp_path / "whole").glob("shard_*.bin"):
        assert path.read_bytes() == (tmp_path / "small" / path.name).read_bytes()
    assert len(list((tmp_path / "small").glob("shard_*.bin"))) == len(list((tmp_path / "whole").glob("shard_*.bin")))


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
    state = json.loads((tmp_path / "killed" / "tokenize.json").read_text())
    assert state["shards"] == 2
    code, err = cli("tokenize", str(data), "--out", str(tmp_path / "killed"), "--shard-tokens", "300")
    assert (code, err.splitlines()[0]) == (0, f"gpt2 tokenize: resuming from {tmp_path / 'killed' / 'tokenize.json'}: "
                                              f"{state['documents']} documents, {state['tokens']} tokens in 2 shard(s) "
                                              "already written")
    names = sorted(p.name for p in (tmp_path / "whole").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "killed").iterdir())
    for name in names:
        if name.endswith(".bin"):
            assert (tmp_path / "whole" / name).read_bytes() == (tmp_path / "killed" / name).read_bytes()
    code, err = cli("tokenize", str(data), "--out", str(tmp_path / "whole"), "--shard-tokens", "500")
    assert code == 2 and "holds shards of other inputs or settings" in err


def test_tokenize_resumes_only_its_own_inputs_and_says_when_there_is_nothing_to_do(tmp_path: Path) -> None:
    """tokenize.json records each input's size and mtime_ns: an edited corpus is refused, not left with the old shards
    (the same byte count, a later time); a finished run says so rather than reporting as if it had run."""
    text, out = tmp_path / "a.txt", tmp_path / "out"
    text.write_text("hello world one\n")
    args = ["tokenize", str(text), "--out", str(out)]
    assert cli(*args) == (0, f"gpt2 tokenize: 1 documents, 5 tokens in 1 shard(s) in {out}\n")
    assert cli(*args) == (0, f"gpt2 tokenize: already tokenized ({out / 'tokenize.json'}): 1 documents, 5 tokens in "
                             "1 shard(s); nothing to do\n")
    refused = "gpt2 tokenize: error: {}: holds shards of other inputs or settings (tokenize.json: {}); give another --out " \
              "or delete it\n"
    saved = text.stat()
    text.write_text("hello world two\n")
    os.utime(text, ns=(saved.st_atime_ns, saved.st_mtime_ns + 10**9))
    assert cli(*args) == (2, refused.format(out, f"{text} changed since it was tokenized"))
    assert cli("tokenize", str(text), str(tmp_path / "b.txt"), "--out", str(out)) == \
        (2, f"gpt2 tokenize: error: {tmp_path / 'b.txt'}: no such file\n")
    (tmp_path / "b.txt").write_text("more\n")
    assert cli("tokenize", str(text), str(tmp_path / "b.txt"), "--out", str(out), "--shard-tokens", "7") == \
        (2, refused.format(out, "--shard-tokens was 100000000, other input files"))
    state = json.loads((out / "tokenize.json").read_text())
    state["settings"]["inputs"] = [str(text)]  # as the last version wrote it: paths only
    (out / "tokenize.json").write_text(json.dumps(state))
    text.write_text("hello world one\n")
    os.utime(text, ns=(saved.st_atime_ns, saved.st_mtime_ns))
    assert cli(*args) == (2, refused.format(out, "written by an older gpt2 tokenize, which did not record its inputs' "
                                                 "sizes and times"))
    state["settings"]["inputs"] = [{"path": str(text), "size": saved.st_size, "mtime_ns": saved.st_mtime_ns}]
    (out / "tokenize.json").write_text(json.dumps(state))
    assert cli(*args)[0] == 0  # the input as it was: nothing to do


def with_fields(**fields):
    """An edit of tokenize.json: these fields replaced."""
    return lambda path: path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))


@pytest.mark.parametrize("edit, what", [
    (lambda p: p.write_text("{garbage"), "not JSON: Expecting property name enclosed in double quotes: line 1 column 2 "
                                         "(char 1)"),
    (lambda p: p.write_text("[1]"), "[1], not a JSON object"),
    (lambda p: p.write_text('{"settings": "x"}'), '"settings" is "x"; expected an object'),
    (lambda p: p.write_bytes(b'{"a": "\xff"}'), r"not JSON: 'utf-8' codec can't decode byte 0xff in position 7: invalid "
                                               "start byte"),
    (lambda p: (p.unlink(), os.mkfifo(p)), "a FIFO"),
    (with_fields(documents="x"), "\"documents\" is 'x'; expected a count"),
    (with_fields(documents=10**30, done=False), "\"documents\" is 1000000000000000000000000000000; expected a count"),
    (with_fields(done=1), "\"done\" is 1; expected true or false"),
    (with_fields(tokens=0), "1 documents and 0 tokens in 1 shard(s) do not add up"),
    (with_fields(shards=2, documents=2), "it counts 2 shard(s), and shard_000001.bin is missing"),
    (lambda p: ((p.parent / "shard_000000.bin").write_bytes(bytes(10)), with_fields(done=False)(p)),
     "its shard shard_000000.bin is damaged: not a token shard (expected llm.c's magic 20240520 in a 1024-byte "
     "header)"),
], ids=["garbage", "a list", "settings a string", "not UTF-8", "a FIFO", "documents a string", "documents past 2^63",
        "done a number", "no tokens", "a shard missing", "a shard damaged"])
def test_a_damaged_tokenize_state_is_one_line(edit, what, tmp_path: Path) -> None:
    """tokenize.json is read with the bounded JSON reader and each field checked: a damaged one was an internal
    error (JSONDecodeError, AttributeError, islice's ValueError), a FIFO hung the run."""
    (tmp_path / "a.txt").write_text("hello world one\n")
    assert cli("tokenize", str(tmp_path / "a.txt"), "--out", str(tmp_path / "out"))[0] == 0
    state = tmp_path / "out" / "tokenize.json"
    edit(state)
    assert cli("tokenize", str(tmp_path / "a.txt"), "--out", str(tmp_path / "out")) == \
        (2, f"gpt2 tokenize: error: {state}: not a tokenize state ({what}); delete it or give another --out\n")


def test_tokenize_refuses_an_input_it_would_replace(tmp_path: Path) -> None:
    """An input named as one of the run's outputs in DIR (a shard of its --prefix, its state) was replaced by them."""
    out = tmp_path / "c3"
    out.mkdir()
    for name, prefix in (("shard_000000.bin", "shard"), ("P_000000.bin", "P"), ("tokenize.json", "shard")):
        (out / name).write_text("some text\n")
        assert cli("tokenize", str(out / name), "--out", str(out), "--prefix", prefix) == \
            (2, f"gpt2 tokenize: error: --out {out / name}: is {out / name}, one of the inputs, which writing would "
                "replace; write the results somewhere else\n")
        assert (out / name).read_text() == "some text\n"
        (out / name).unlink()
    (tmp_path / "x.txt").write_text("some text\n")
    os.link(tmp_path / "x.txt", out / "shard_000003.bin")  # another name of the same file
    assert cli("tokenize", str(tmp_path / "x.txt"), "--out", str(out))[0] == 2
    assert (tmp_path / "x.txt").read_text() == "some text\n"


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
