"""Reading text input: each FILE is one UTF-8 document, a `.jsonl` file holds one document per line in its "text"
field, `-` is stdin. Every reading error is one line that names the file (and the line or byte offset).

Every command reads its text through this module: `gpt2 score`, `finetune` and `tokenize` their documents (and
score's Ray workers), `generate`, `inspect` and `sae features` a prompt, `compare` its prompts file. GPT-2's tokenizer
takes text, so input that is not UTF-8 is refused, at the first invalid byte, wherever it comes from.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from collections.abc import Iterator, Sequence
from typing import IO, Any

from .core.config import memory_left
from .core.config import read_bytes as read_bounded
from .core.errors import InputError
from .core.pages import available_memory


# The most one input may hold, checked before it is read (a sparse file, /dev/zero or an endless pipe would otherwise
# be read whole: tokenizing takes ~30 bytes of memory per byte of text). A prompt, a schema or a prompts file is far
# below PROMPT_BYTES (the context is 1,024 tokens, ~4 KB of text); one document of a corpus below DOCUMENT_BYTES.
PROMPT_BYTES = 16 << 20
DOCUMENT_BYTES = 256 << 20
SPLIT_HINT = "split a corpus into documents (a .jsonl file, one per line)"


def decode_utf8(data: bytes, name: str, base: int = 0) -> str:
    """`data` as text; invalid UTF-8 is an InputError that names the file and the byte offset."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"{name}: invalid UTF-8 at byte offset {base + e.start} (expected UTF-8 text)") from None


def read_bytes(path: str, stdin: IO[bytes], name: str | None = None, limit: int = PROMPT_BYTES) -> bytes:
    """The bytes of a file, or of stdin for `-`, at most `limit` of them; errors name the file as `name` (default:
    its path)."""
    name = name or path
    try:
        return read_bounded(path, limit, "text", name, stdin)
    except InputError as e:
        raise InputError(f"{e}; {SPLIT_HINT}" if limit == DOCUMENT_BYTES else str(e)) from None
    except FileNotFoundError:
        raise InputError(f"{name}: no such file") from None
    except IsADirectoryError:
        raise InputError(f"{name}: is a directory, expected a text or .jsonl file") from None
    except OSError as e:
        raise InputError(f"{name}: cannot read ({e.strerror or e})") from None


def read_text(path: str | Path, stdin: IO[bytes], flag: str = "", limit: int = PROMPT_BYTES) -> str:
    """One whole input as text, at most `limit` bytes: a UTF-8 file, or stdin for `-`. Errors name it as `FLAG PATH`
    (`flag`: the option that gave the path, if one did), or as stdin."""
    path = str(path)
    name = "stdin" if path == "-" else f"{flag} {path}".lstrip()
    data = read_bytes(path, stdin, name, limit)
    check_tokenizable(name, len(data))
    return decode_utf8(data, name)


# tiktoken's BPE maps up to about 50 bytes of address space per byte of one piece (a run without spaces, which
# GPT-2's pre-tokenizer does not split; measured with tiktoken 0.14: 1.5 GB for a 30 MB run). A text is refused where
# that, with some margin, could not fit.
BPE_BYTES_PER_BYTE = 64


def check_tokenizable(name: str, size: int) -> None:
    """Refuse, before tiktoken is asked, a text of `size` UTF-8 bytes whose BPE could not fit in what this process may
    still allocate (tiktoken aborts the whole process, a Rust backtrace, where an allocation fails)."""
    if size < 1 << 20:  # at most 40 MB to tokenize: not worth asking the OS, once for every line of a corpus
        return
    room = min(available_memory(), memory_left())
    if size * BPE_BYTES_PER_BYTE > room:
        raise InputError(f"{name}: {size / 2**20:,.0f} MiB of text may need {size * BPE_BYTES_PER_BYTE / 1e9:,.1f} GB to "
                         f"tokenize (a run without spaces is one piece); this process has {room / 1e9:,.1f} GB "
                         "available: split it into documents (a .jsonl file, one per line)")


def file_stamps(paths: Sequence[str]) -> list[dict[str, Any]]:
    """Each input file's path, size and mtime_ns: what a resumable run (gpt2 tokenize, gpt2 sae dashboard) records to
    tell whether its input changed since, as make judges a file by its time (a hash would read the corpus once more;
    only an edit that keeps the size within one tick of the file system's clock goes unseen)."""
    stamps = []
    for path in paths:
        try:
            found = os.stat(path)
        except FileNotFoundError:
            raise InputError(f"{path}: no such file") from None
        except OSError as e:
            raise InputError(f"{path}: cannot read ({e.strerror or e})") from None
        stamps.append({"path": path, "size": found.st_size, "mtime_ns": found.st_mtime_ns})
    return stamps


def read_documents(paths: list[str], stdin: IO[bytes]) -> list[tuple[str, str]]:
    """(name, text) of every document, in input order: `PATH:N` for line N of a .jsonl file, `-` for stdin."""
    return list(iter_documents(paths, stdin))


def iter_documents(paths: list[str], stdin: IO[bytes]) -> Iterator[tuple[str, str]]:
    """read_documents' documents one at a time: a .jsonl file is read line by line, so a corpus of any size costs
    one document's memory (gpt2 tokenize)."""
    for path in paths:
        if not path.endswith(".jsonl") or path == "-":
            yield path, read_text(path, stdin, limit=DOCUMENT_BYTES)
            continue
        try:
            f = open(path, "rb")
        except FileNotFoundError:
            raise InputError(f"{path}: no such file") from None
        except OSError as e:
            raise InputError(f"{path}: cannot read ({e.strerror or e})") from None
        with f:
            offset = 0
            for n, line in enumerate(iter(functools.partial(f.readline, DOCUMENT_BYTES + 1), b""), start=1):
                where, base, offset = f"{path}:{n}", offset, offset + len(line)
                if len(line) > DOCUMENT_BYTES:
                    raise InputError(f"{where}: more than {DOCUMENT_BYTES >> 20} MiB; expected a document of at most "
                                     f"{DOCUMENT_BYTES >> 20} MiB")
                if not line.strip():
                    continue
                try:
                    record = json.loads(decode_utf8(line, path, base))
                except json.JSONDecodeError as e:
                    raise InputError(f"{where}: not valid JSON ({e.msg}); expected one JSON object per line") from None
                if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                    raise InputError(f"{where}: expected a JSON object with a string \"text\" field")
                text = record["text"]
                check_tokenizable(where, len(text) if text.isascii() else len(text.encode("utf-8")))  # what BPE reads
                yield where, text


TEXT_SUFFIXES = (".txt", ".md", ".rst", ".jsonl", ".text")


def expand_paths(paths: list[str]) -> list[str]:
    """The paths with each directory replaced by the text files under it (.txt, .md, .rst, .text, .jsonl; hidden
    files and folders skipped), sorted, so that a folder of text is a corpus. An empty folder is an InputError."""
    expanded: list[str] = []
    for path in paths:
        p = Path(path)
        if path == "-" or not p.is_dir():
            expanded.append(path)
            continue
        found = sorted(str(f) for f in p.rglob("*") if f.is_file() and f.suffix.lower() in TEXT_SUFFIXES
                       and not any(part.startswith(".") for part in f.relative_to(p).parts))
        if not found:
            raise InputError(f"{path}: the folder holds no text files (expected {', '.join(TEXT_SUFFIXES)})")
        expanded += found
    return expanded
