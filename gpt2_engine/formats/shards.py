"""Token shards in llm.c's format: a corpus tokenized once, then memory-mapped by `gpt2 score` and `gpt2 finetune`.

A shard is 256 int32 of header (magic 20240520, version 1, the token count), then the tokens as little-endian uint16
(GPT-2's 50,257 ids fit). llm.c's data scripts (fineweb.py, tinyshakespeare.py) open every document with
<|endoftext|>, so a shard is a stream of documents each starting with it; `gpt2 tokenize` writes the same.
"""

from __future__ import annotations

import errno
import hashlib
import os
from bisect import bisect_right
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from ..core.config import GPT2_VOCAB
from ..core.errors import GPT2EngineError
from .files import atomic_write

SHARD_MAGIC = 20240520
SHARD_VERSION = 1
HEADER_INTS = 256
SUFFIX = ".bin"


class ShardError(GPT2EngineError):
    """A token shard that cannot be read."""


def is_shard(path: Path) -> bool:
    """Whether `path` is a file that starts with a token shard's magic."""
    if not path.is_file() or path.suffix != SUFFIX:
        return False
    with open(path, "rb") as f:
        head = f.read(4)
    return len(head) == 4 and int.from_bytes(head, "little") == SHARD_MAGIC


def read_shard(path: Path) -> np.ndarray:
    """A shard's tokens, memory-mapped [n] uint16, after checking its header against its size."""
    n = shard_length(path)
    if n == 0:
        return np.zeros(0, dtype="<u2")  # numpy cannot map nothing
    try:
        tokens = np.memmap(path, dtype="<u2", mode="r", offset=HEADER_INTS * 4, shape=(n,))
    except OSError as e:
        why = ("more address space than this process may use" if e.errno == errno.ENOMEM
               else os.strerror(e.errno) if e.errno else str(e))
        raise ShardError(f"{path}: cannot map its {n:,} tokens ({2 * n / 2**30:.1f} GiB) into memory: {why}") from None
    check_ids(tokens, path)
    return tokens


def shard_length(path: Path) -> int:
    """The number of tokens a shard's header declares, once checked against its magic, version and size."""
    header = np.fromfile(path, dtype="<i4", count=HEADER_INTS)
    if header.shape[0] != HEADER_INTS or header[0] != SHARD_MAGIC:
        raise ShardError(f"{path}: not a token shard (expected llm.c's magic {SHARD_MAGIC} in a 1024-byte header)")
    if header[1] != SHARD_VERSION:
        raise ShardError(f"{path}: token shard version {int(header[1])} (expected {SHARD_VERSION})")
    n = int(header[2])
    size = path.stat().st_size
    if size != HEADER_INTS * 4 + 2 * n:
        raise ShardError(f"{path}: the header says {n} tokens, the file holds {(size - HEADER_INTS * 4) // 2} "
                         f"({'truncated' if size < HEADER_INTS * 4 + 2 * n else 'bytes left over'})")
    return n


CHECK_TOKENS = 1 << 24  # tokens scanned at a time (32 MB of the mapping)


def check_ids(tokens: np.ndarray, path: Path) -> None:
    """Every id a GPT-2 token (below 50,257): a larger one would index past the embedding."""
    for start in range(0, tokens.size, CHECK_TOKENS):
        part = tokens[start : start + CHECK_TOKENS]
        if int(part.max()) >= GPT2_VOCAB:
            at = start + int(np.flatnonzero(part >= GPT2_VOCAB)[0])
            raise ShardError(f"{path}: token {int(tokens[at])} at position {at:,} is not a GPT-2 token id "
                             f"(0..{GPT2_VOCAB - 1})")


def write_shard(path: Path, tokens: np.ndarray) -> None:
    """A shard of `tokens` (ids below 65,536), written beside `path` and renamed over it."""
    tokens = np.asarray(tokens)
    if tokens.size and (tokens.min() < 0 or tokens.max() >= 2**16):
        raise ShardError(f"{path}: token ids must fit uint16 (0..65535)")
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:3] = [SHARD_MAGIC, SHARD_VERSION, tokens.size]

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            f.write(header.tobytes())
            f.write(tokens.astype("<u2").tobytes())

    atomic_write(path, write)


def shard_files(paths: Sequence[str | Path]) -> list[Path] | None:
    """The shards that `paths` name (files, or folders of *.bin shards, sorted), or None when they name text (no
    shard among them). Shards mixed with text are an error."""
    found: list[Path] = []
    text = False
    for p in map(Path, paths):
        if str(p) != "-" and p.is_dir():
            bins = sorted(f for f in p.iterdir() if f.suffix == SUFFIX and not f.name.startswith("."))
            if bins and all(is_shard(f) for f in bins):
                found += bins
                continue
        if str(p) != "-" and is_shard(p):
            found.append(p)
        else:
            text = True
    if found and text:
        raise ShardError("give either token shards (llm.c's .bin) or text files, not both")
    return found or None


def documents(tokens: np.ndarray, eot: int) -> Iterator[tuple[int, int]]:
    """[start, end) of each document of a shard: each begins at an <|endoftext|> (text before the first one, if
    any, is a document too)."""
    if not tokens.size:
        return
    starts = np.flatnonzero(tokens == eot)
    if not starts.size or starts[0] != 0:
        starts = np.concatenate([[0], starts])
    ends = np.append(starts[1:], tokens.size)
    yield from zip(starts.tolist(), ends.tolist())


class TokenStream:
    """Shards (or a slice of them) read as one stream of token ids: len(), and stream[a:b] as a LongTensor, read
    from the memory-mapped files (so any corpus size costs the pages read, not the corpus)."""

    def __init__(self, arrays: Sequence[np.ndarray], start: int = 0, stop: int | None = None) -> None:
        self.arrays = list(arrays)
        self.offsets = np.cumsum([0] + [a.size for a in self.arrays]).tolist()  # where each array starts
        self.start, self.stop = start, self.offsets[-1] if stop is None else stop

    @classmethod
    def of(cls, paths: Sequence[Path]) -> TokenStream:
        return cls([read_shard(p) for p in paths])

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, key: slice) -> torch.Tensor:
        lo, hi, step = key.indices(len(self))
        if step != 1:
            raise IndexError("a token stream is read in contiguous slices")
        lo, hi = self.start + lo, self.start + max(hi, lo)
        parts = []
        while lo < hi:
            k = bisect_right(self.offsets, lo) - 1
            end = min(hi, self.offsets[k + 1])
            parts.append(self.arrays[k][lo - self.offsets[k] : end - self.offsets[k]])
            lo = end
        joined = np.concatenate(parts) if parts else np.zeros(0, dtype="<u2")
        return torch.from_numpy(joined.astype(np.int64))

    def split(self, fraction: float) -> tuple[TokenStream, TokenStream]:
        """(the first 1 - fraction of the tokens, the rest): training and validation."""
        cut = self.start + int(len(self) * (1 - fraction))
        return TokenStream(self.arrays, self.start, cut), TokenStream(self.arrays, cut, self.stop)

    def digest(self) -> str:
        """The first 16 hex digits of the sha256 of the tokens (as int64, as a token tensor's fingerprint)."""
        h = hashlib.sha256()
        for i in range(0, len(self), 1 << 22):
            h.update(self[i : i + (1 << 22)].numpy().tobytes())
        return h.hexdigest()[:16]
