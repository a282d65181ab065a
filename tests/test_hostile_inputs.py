"""Hostile inputs, reader by reader: files of a few bytes that declare terabytes, configs nested 100,000 deep or with
a string where a number goes, pickles that ask to run code, weights that are all NaN, and outputs that are not files.

Each case runs in a child process whose address space is capped (RLIMIT_AS) and whose time is bounded, so a reader
that allocates what a file declares, or loops over it, fails its case (a MemoryError is an internal error, exit 1)
instead of taking the machine. A command must answer with exit 2 and one line on stderr matching the case's pattern;
a library call must raise the case's exception with a message matching it.

The corpus grows with every reader: a case is the crafted bytes (`make` writes them under a temporary folder and
returns the command's arguments or the call to make), the expected line and the exit code or exception.
"""

from __future__ import annotations

import gzip
import json
import os
import pickle
import re
import shutil
import socket
import stat
import struct
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import cli
from test_files import Reader, device, small_disk

# Most cases start a capped child process (an interpreter and torch each, seconds): the corpus runs in `make test`,
# and `make test-fast`, the inner loop, leaves it out.
pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent
MEMORY = 3 << 30  # address space of a child: the interpreter, torch and a small model fit; a file's claim does not
TIMEOUT = 180  # seconds a child may take (a loaded 2-core machine imports torch in a few)


# The cases run in children forked from one server process per pytest worker that has imported torch and the engine
# once (a fresh interpreter per case spent ~2 s of CPU importing them, most of this file's time). Each child is a
# process of its own as before: its address space capped, stdin and stdout /dev/null, stderr captured, killed past
# TIMEOUT; a crash (a signal) is its exit status, as subprocess reports it.
FORK_SERVER = r"""
import json, os, resource, select, signal, sys, time
import torch
import gpt2_engine.cli

CALL_RESULT = 3

def child(job, w):
    resource.setrlimit(resource.RLIMIT_AS, (job["memory"], job["memory"]))
    os.chdir(job["cwd"])
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0), os.dup2(null, 1), os.dup2(w, 2)
    if "call" not in job:
        try:
            code = gpt2_engine.cli.main(job["args"])
        except SystemExit as e:  # argparse's usage errors
            code = e.code if isinstance(e.code, int) else 1
        sys.stderr.flush()
        os._exit(code)
    try:
        exec(job["call"], {})
        result = [None, ""]
    except Exception as e:
        result = [type(e).__name__, str(e)]
    sys.stderr.write(json.dumps(result))
    sys.stderr.flush()
    os._exit(0)

for line in sys.stdin:
    job = json.loads(line)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            child(job, w)
        finally:
            os._exit(70)
    os.close(w)
    out, deadline, timed_out = b"", time.monotonic() + job["timeout"], False
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([r], [], [], left)[0]:
            os.kill(pid, signal.SIGKILL)
            timed_out = True
            break
        chunk = os.read(r, 1 << 16)
        if not chunk:
            break
        out += chunk
    os.close(r)
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    print(json.dumps([None if timed_out else code, out.decode("utf-8", "replace")]), flush=True)
"""


class ForkServer:
    """One FORK_SERVER process, started at its first case."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None

    def run(self, job: dict) -> tuple[int, str]:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = subprocess.Popen([sys.executable, "-c", FORK_SERVER], cwd=ROOT, stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, text=True)
        self.proc.stdin.write(json.dumps({"timeout": TIMEOUT, **job}) + "\n")
        self.proc.stdin.flush()
        code, err = json.loads(self.proc.stdout.readline())
        assert code is not None, f"the case ran past {TIMEOUT} s: {job}"
        return code, err

    def close(self) -> None:
        if self.proc is not None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


SERVER = ForkServer()  # this worker's; the fixture below closes it when the module's tests are done


@pytest.fixture(scope="module", autouse=True)
def _close_the_fork_server():
    yield
    SERVER.close()


def run_cli(args: list[str], memory: int = MEMORY, cwd: Path = ROOT) -> tuple[int, str]:
    """`gpt2 ARGS` in a child capped at `memory` bytes of address space: (exit code, stderr)."""
    return SERVER.run({"args": [str(a) for a in args], "memory": memory, "cwd": str(cwd)})


def run_call(statement: str, memory: int = MEMORY) -> tuple[str | None, str]:
    """A Python statement in a capped child: (the exception it raised or None, its message)."""
    code, out = SERVER.run({"call": statement, "memory": memory, "cwd": str(ROOT)})
    assert code == 0, out[-2000:]
    kind, message = json.loads(out.strip().splitlines()[-1])
    return kind, message


def one_line_error(code: int, err: str, pattern: str) -> None:
    """A command's user error: exit 2 and one line on stderr, matching `pattern` after 'gpt2 CMD: error: '."""
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, (code, err[-3000:])
    assert re.fullmatch(r"gpt2 [\w-]+: error: .*", lines[0]) and re.search(pattern, lines[0]), lines[0]


# --- crafting ----------------------------------------------------------------------------------------------------


def gguf_string(text: str | bytes, length: int | None = None) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw) if length is None else length) + raw


def gguf(kvs: bytes = b"", n_kv: int = 0, tensors: bytes = b"", n_tensors: int = 0, tail: bytes = b"") -> bytes:
    """A GGUF v3 file's bytes: header, the key-values and tensor infos given, then `tail`."""
    return b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kv) + kvs + tensors + tail


def array_kv(key: str, element_type: int, count: int) -> bytes:
    return gguf_string(key) + struct.pack("<IIQ", 9, element_type, count)


def gguf_file(name: str, data: bytes) -> Callable[[Path], list[str]]:
    def make(tmp: Path) -> list[str]:
        (tmp / name).write_bytes(data)
        return ["convert", str(tmp / name), str(tmp / "out.bin"), "--to", "llmc"]
    return make


def gguf_metadata(tmp: Path, tokens: list[str] | None = None, **fields: object) -> Path:
    """A GGUF written by gguf-py with GPT-2's metadata (GPT-2 small's numbers unless `fields` say otherwise) and no
    tensors."""
    import gguf as gg

    values = {"context_length": 1024, "embedding_length": 768, "block_count": 12, "head_count": 12,
              "feed_forward_length": 3072, **fields}
    path = tmp / "meta.gguf"
    w = gg.GGUFWriter(str(path), "gpt2")
    for key, value in values.items():
        name = f"gpt2.attention.{key}" if key == "head_count" else f"gpt2.{key}"
        w.add_string(name, value) if isinstance(value, str) else w.add_uint32(name, value)
    w.add_layer_norm_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens or ["a", "b", "c"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def gpt2_tokens() -> list[str]:
    from gpt2_engine.core.tokenizer import load_tokenizer
    from gpt2_engine.formats.gguf import bpe_tables

    return bpe_tables(load_tokenizer(None).source)[0]


def llmc_header(path: Path, layers: int, channels: int, heads: int = 8, positions: int = 1024,
                padded: int = 50304) -> None:
    header = np.zeros(256, dtype="<i4")
    header[:8] = [20240326, 3, positions, 50257, layers, heads, channels, padded]
    path.write_bytes(header.tobytes())


def sparse_llmc(tmp: Path) -> list[str]:
    """A valid llm.c header over a sparse file of exactly the size it declares (64 layers of 8,192 channels: 206 GB)."""
    import math

    from gpt2_engine.core.config import GPT2Config
    from gpt2_engine.formats.llmc import llmc_layout

    path = tmp / "huge.bin"
    llmc_header(path, 64, 8192, heads=64)
    config = GPT2Config(n_layer=64, n_embd=8192, n_head=64)
    with open(path, "r+b") as f:
        f.truncate(1024 + 4 * sum(math.prod(s) for _, s in llmc_layout(config, 50304)))
    return ["convert", str(path), str(tmp / "out.gguf"), "--to", "gguf"]


def nanogpt(tmp: Path, **args: object) -> list[str]:
    model_args = {"n_layer": 2, "n_head": 4, "n_embd": 64, "block_size": 64, "bias": True, "vocab_size": 50304,
                  "dropout": 0.0, **args}
    torch.save({"model": {}, "model_args": model_args, "iter_num": 0}, tmp / "ckpt.pt")
    return ["convert", str(tmp / "ckpt.pt"), str(tmp / "out.bin"), "--to", "llmc"]


class Payload:
    """A pickle that runs code when loaded (print, through exec): what a hostile checkpoint would do with os.system.
    exec rather than print itself: where Ray has been imported in this process, `print` is Ray's own function."""

    def __reduce__(self):
        return (exec, ("print('this ran')",))


def nanogpt_raw(tmp: Path, ckpt: object) -> list[str]:
    torch.save(ckpt, tmp / "ckpt.pt")
    return ["convert", str(tmp / "ckpt.pt"), str(tmp / "out.bin"), "--to", "llmc"]


def fifo_dir(tmp: Path, name: str) -> Path:
    (tmp / "d").mkdir()
    os.mkfifo(tmp / "d" / name)
    return tmp / "d"


def openai_sae(tmp: Path, encoder: torch.Tensor) -> list[str]:
    torch.save({"encoder.weight": encoder, "decoder.weight": torch.zeros(4, 4)}, tmp / "sae.pt")
    return ["sae", "features", "The cat", "--weights", str(tmp / "ckpt"), "--sae", str(tmp / "sae.pt"), "--hook",
            "blocks.1.hook_resid_pre"]


def deflated(tmp: Path) -> list[str]:
    """A nanoGPT checkpoint whose zip entries are deflated: 100 MB of zeros in a file of 100 KB, which torch.load would inflate."""
    import zipfile

    torch.save({"model": {"w": torch.zeros(1)}, "model_args": {}}, tmp / "plain.pt")
    with zipfile.ZipFile(tmp / "plain.pt") as src, zipfile.ZipFile(tmp / "ckpt.pt", "w") as dst:
        for entry in src.infolist():
            if entry.filename.endswith("data/0"):
                dst.writestr(entry.filename, bytes(100_000_000), compress_type=zipfile.ZIP_DEFLATED)
            else:
                dst.writestr(entry.filename, src.read(entry.filename))
    return ["convert", str(tmp / "ckpt.pt"), str(tmp / "out.bin"), "--to", "llmc"]


def with_code(tmp: Path) -> list[str]:
    torch.save({"model": {"x": torch.zeros(2)}, "model_args": Payload()}, tmp / "ckpt.pt")
    return ["convert", str(tmp / "ckpt.pt"), str(tmp / "out.bin"), "--to", "llmc"]


TINY = {"vocab_size": 50257, "n_positions": 128, "n_embd": 64, "n_layer": 2, "n_head": 4, "model_type": "gpt2"}


def hf_dir(tmp: Path, config: dict | str, weights: Callable[[Path], None] | None = None) -> list[str]:
    d = tmp / "model"
    d.mkdir()
    (d / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    if weights is None:
        from safetensors.torch import save_file

        save_file({"wte.weight": torch.zeros(4, 4)}, str(d / "model.safetensors"))
    else:
        weights(d)
    return ["convert", str(d), str(tmp / "out.bin"), "--to", "llmc"]


def pickled_bin(d: Path) -> None:
    torch.save({"wte.weight": torch.zeros(2), "h.0.ln_1.weight": Payload()}, d / "pytorch_model.bin")


def legacy_tar(d: Path) -> None:
    """pytorch_model.bin in torch's pre-zip tar layout, its pickles asking for exec."""
    import io
    import tarfile

    with tarfile.open(d / "pytorch_model.bin", "w") as archive:
        for name in ("sys_info", "pickle", "storages", "tensors"):
            data = pickle.dumps({"x": Payload()}, protocol=2)
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))


NESTED = "[" * 100_000 + "]" * 100_000


# --- the command-line corpus -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    name: str
    make: Callable[[Path], list[str]]  # writes the crafted files into a folder, returns the command's arguments
    pattern: str  # what the one stderr line says


CLI_CASES = [
    # GGUF (item 5): every count and length against the bytes left, before gguf-py trusts them
    Case("gguf-array-of-2^40-uint8", gguf_file("a.gguf", gguf(array_kv("tokenizer.ggml.token_type", 0, 1 << 40), 1,
                                                              tail=bytes(64))),
         r"the array tokenizer.ggml.token_type declares 1,099,511,627,776 of at least 1 bytes each, and 64 bytes are left"),
    Case("gguf-array-of-2^40-strings", gguf_file("a.gguf", gguf(array_kv("tokenizer.ggml.tokens", 8, 1 << 40), 1,
                                                                tail=bytes(64))),
         r"the array tokenizer.ggml.tokens declares 1,099,511,627,776 of at least 8 bytes each, and 64 bytes are left"),
    Case("gguf-string-of-2^62-bytes", gguf_file("a.gguf", gguf(gguf_string(b"k" * 8, length=1 << 62), 1, tail=bytes(40))),
         r"a key at byte 32 needs 4,611,686,018,427,387,904 bytes, and 48 are left"),
    Case("gguf-2^63-key-values", gguf_file("a.gguf", gguf(n_kv=1 << 63, tail=bytes(100))),
         r"the key-value count declares 9,223,372,036,854,775,808 of at least 13 bytes each, and 100 bytes are left"),
    Case("gguf-a-million-key-values",  # each fits in the file; gguf-py's fields for them took 3 GB and a minute
         gguf_file("a.gguf", gguf(b"".join(gguf_string(f"k{i:07}") + struct.pack("<IB", 0, 1) for i in range(1 << 20)),
                                  n_kv=1 << 20)),
         r"not a GGUF the engine reads: 1,048,576 key-values \(a GPT-2's GGUF has about 20; the engine reads at most 4,096\)$"),
    Case("gguf-2^40-tensors", gguf_file("a.gguf", gguf(n_tensors=1 << 40)), r"1,099,511,627,776 tensors \(a GPT-2 has at most 65,536\)"),
    Case("gguf-tensor-past-the-end", gguf_file("a.gguf", gguf(tensors=gguf_string("token_embd.weight")
                                                              + struct.pack("<IQQIQ", 2, 768, 50257, 0, 0), n_tensors=1)),
         r"tensor token_embd.weight's 154,389,504 bytes at byte 96 run past the end of the file \(81 bytes\)"),
    Case("gguf-array-of-arrays", gguf_file("a.gguf", gguf(array_kv("x", 9, 1) + struct.pack("<IQ", 0, 1) + b"\0", 1)),
         r"x is an array of arrays \(llama.cpp's reader refuses them too\)"),
    Case("gguf-unknown-value-type", gguf_file("a.gguf", gguf(gguf_string("k") + struct.pack("<I", 13) + bytes(8), 1)),
         r"k has GGUF value type 13, which is none of GGUF's \(0 to 12\)"),
    Case("gguf-more-values-than-a-gpt2", gguf_file("a.gguf", gguf(array_kv("x", 0, (1 << 18) + 1), 1,
                                                                  tail=bytes((1 << 18) + 1))),
         r"262,145 array values in its metadata at x \(a GPT-2's metadata holds 150,514; the engine reads at most 262,144\)"),
    Case("gguf-a-million-empty-strings", gguf_file("a.gguf", gguf(array_kv("tokenizer.ggml.tokens", 8, 1 << 20), 1,
                                                                  tail=bytes(8 << 20))),
         r"1,048,576 array values in its metadata at tokenizer.ggml.tokens \(a GPT-2's metadata holds 150,514; the "
         r"engine reads at most 262,144\)"),
    Case("gguf-5-dimensions", gguf_file("a.gguf", gguf(tensors=gguf_string("t") + struct.pack("<I5QIQ", 5, 1, 1, 1, 1, 1, 0, 0),
                                                       n_tensors=1)), r"tensor t has 5 dimensions \(expected 1 to 4\)"),
    Case("gguf-unknown-ggml-type", gguf_file("a.gguf", gguf(tensors=gguf_string("t") + struct.pack("<IQIQ", 1, 32, 999, 0),
                                                            n_tensors=1)), r"tensor t has ggml type 999, which gguf-py does not know"),
    Case("gguf-truncated", gguf_file("a.gguf", b"GGUF"), r"the version at byte 4 needs 4 bytes, and 0 are left"),
    Case("gguf-n_layer-2^31", lambda tmp: ["convert", str(gguf_metadata(tmp, block_count=1 << 31)), str(tmp / "o.bin"),
                                           "--to", "llmc"],
         r"n_layer must be a positive integer up to 4,096, got 2147483648"),
    Case("gguf-context-length-a-string", lambda tmp: ["convert", str(gguf_metadata(tmp, context_length="1024")),
                                                      str(tmp / "o.bin"), "--to", "llmc"],
         r"gpt2.context_length \(n_positions\) has GGUF value type \[8\], expected one of \[0, 1, 2, 3, 4, 5, 10, 11\]"),
    Case("gguf-xl-config-in-a-small-file", lambda tmp: ["convert", str(gguf_metadata(
        tmp, gpt2_tokens(), block_count=48, embedding_length=1600, head_count=25, feed_forward_length=6400)),
        str(tmp / "o.bin"), "--to", "llmc"],
        r"its config \(n_layer 48, n_embd 1600, vocab_size 50257, n_positions 1024\) means 1,557,611,200 parameters, "
        r"and the file holds [\d,]+ bytes"),
    # item 8: a .gguf without GGUF's magic, and what the engine reads, GGUF included
    Case("gguf-garbage", gguf_file("model.gguf", b"not a gguf at all"),
         r"not a checkpoint the engine reads \(a .gguf file without its format's magic bytes; expected a Hugging Face "
         r"directory, nanoGPT's ckpt.pt, llm.c's model .bin or a GGUF\)"),
    # llm.c (item 5): a sparse file of the size its header declares is memory-mapped, and its copies checked first
    Case("llmc-sparse-206GB", sparse_llmc,
         r"its 51,\d{3},\d{3},\d{3} parameters \(n_layer 64, n_embd 8192, vocab_size 50257, n_positions 1024\) need "
         r"19\d\.\d GiB as float32, more than the 3.0 GiB of memory this process may use"),
    Case("llmc-n_layer-1e9", lambda tmp: (llmc_header(tmp / "m.bin", 10**9, 64), ["convert", str(tmp / "m.bin"),
                                                                                  str(tmp / "o.gguf"), "--to", "gguf"])[1],
         r"n_layer must be a positive integer up to 4,096, got 1000000000"),
    # a padded vocabulary of 2^27 rows had the whole (sparse, 32 GB) file mapped: an internal OSError ENOMEM
    Case("llmc-padded-vocabulary-2^27",
         lambda tmp: (llmc_header(tmp / "m.bin", 2, 64, padded=1 << 27), ["generate", "hi", "-n", "2", "--weights",
                                                                          str(tmp / "m.bin")])[1],
         r"m.bin: padded vocabulary 134,217,728; llm.c pads 50,257 to a multiple of 128 \(50,304\), expected at most "
         r"51,281$"),
    # nanoGPT
    Case("nanogpt-n_layer-1e9", lambda tmp: nanogpt(tmp, n_layer=10**9), r"n_layer must be a positive integer up to 4,096"),
    Case("nanogpt-xl-in-a-small-file", lambda tmp: nanogpt(tmp, n_layer=48, n_head=25, n_embd=1600, block_size=1024),
         r"means 1,557,611,200 parameters, and the file holds [\d,]+ bytes"),
    Case("nanogpt-vocab-a-string", lambda tmp: nanogpt(tmp, vocab_size="abc"), r"model_args vocab_size is 'abc', expected an integer"),
    Case("nanogpt-a-zip-bomb", deflated,
         r"not a readable nanoGPT checkpoint \(its zip entry plain/data/0 is compressed \([\d,]+ bytes for "
         r"100,000,000\); torch.save stores its entries as they are\)"),
    Case("nanogpt-pickle-with-code", with_code,
         r"not a readable nanoGPT checkpoint \(its pickle asks for exec, code that loading weights only never runs\)"),
    # Hugging Face config.json (items 5 and 6)
    Case("hf-n_layer-1e9", lambda tmp: hf_dir(tmp, {**TINY, "n_layer": 10**9}),
         r"config: n_layer must be a positive integer up to 4,096, got 1000000000$"),
    Case("hf-n_layer-a-float", lambda tmp: hf_dir(tmp, {**TINY, "n_layer": 1e9}),
         r"config: n_layer must be a positive integer up to 4,096, got 1000000000.0$"),
    Case("hf-n_head-a-bool", lambda tmp: hf_dir(tmp, {**TINY, "n_head": True}), r"config: n_head must be a positive integer up to 4,096, got True$"),
    Case("hf-epsilon-nan-string", lambda tmp: hf_dir(tmp, {**TINY, "layer_norm_epsilon": "nan"}),
         r"config: layer_norm_epsilon must be a number in \(0, 1\), got 'nan'$"),
    Case("hf-epsilon-abc", lambda tmp: hf_dir(tmp, {**TINY, "layer_norm_epsilon": "abc"}), r"got 'abc'$"),
    Case("hf-epsilon-negative", lambda tmp: hf_dir(tmp, {**TINY, "layer_norm_epsilon": -1}),
         r"config: layer_norm_epsilon must be a number in \(0, 1\), got -1$"),
    Case("hf-epsilon-1e300", lambda tmp: hf_dir(tmp, {**TINY, "layer_norm_epsilon": 1e300}),  # inf in float32
         r"config: layer_norm_epsilon must be a number in \(0, 1\), got 1e\+300$"),
    Case("hf-epsilon-NaN-literal", lambda tmp: hf_dir(tmp, json.dumps({**TINY, "layer_norm_epsilon": float("nan")})), r"got nan$"),
    Case("hf-config-nested-100000-deep", lambda tmp: hf_dir(tmp, NESTED), r"config.json: not a readable JSON config \(its values nest too deeply\)"),
    Case("hf-xl-config-in-a-small-file", lambda tmp: hf_dir(tmp, {**TINY, "n_layer": 48, "n_head": 25, "n_embd": 1600,
                                                                  "n_positions": 1024}),
         r"model.safetensors: its config \(n_layer 48, n_embd 1600, vocab_size 50257, n_positions 1024\) means "
         r"1,557,611,200 parameters, and the file holds \d+ bytes"),
    Case("hf-pickle-in-pytorch_model.bin", lambda tmp: hf_dir(tmp, TINY, pickled_bin),
         r"pytorch_model.bin: not a readable PyTorch checkpoint \(its pickle asks for exec, code that loading "
         r"weights only never runs\)"),
    Case("hf-protocol-4-pickle-in-pytorch_model.bin",  # torch's warning about the protocol is not a second line
         lambda tmp: hf_dir(tmp, TINY, lambda d: (d / "pytorch_model.bin").write_bytes(pickle.dumps({"x": Payload()}, protocol=4))),
         r"pytorch_model.bin: not a readable PyTorch checkpoint \(its pickle holds opcode 0x95, which loading weights "
         r"only does not read \(torch.save writes pickle protocol 2\)\)$"),
    Case("hf-gzipped-pytorch_model.bin",
         lambda tmp: hf_dir(tmp, TINY, lambda d: (d / "pytorch_model.bin").write_bytes(gzip.compress(pickle.dumps({"x": Payload()})))),
         r"pytorch_model.bin: not a readable PyTorch checkpoint \(a gzip-compressed file; torch.load reads "
         r"torch.save's files as they are \(gunzip it\)\)$"),
    Case("hf-legacy-tar-pytorch_model.bin", lambda tmp: hf_dir(tmp, TINY, legacy_tar),  # torch's message: retry unsafely
         r"pytorch_model.bin: not a readable PyTorch checkpoint \(torch's legacy tar format, which loading weights only "
         r"does not read \(re-save it with a current torch.save from a source you trust\)\)$"),
    # the thirteenth attack: tensors with no values (meta) or not dense (sparse) were internal errors in every reader
    *(Case(f"hf-{kind}-tensor-in-pytorch_model.bin",
           lambda tmp, make=make: hf_dir(tmp, TINY, lambda d: torch.save({"wte.weight": make()}, d / "pytorch_model.bin")),
           rf"pytorch_model.bin: not a readable PyTorch checkpoint \(its tensor wte.weight is a {kind} tensor; "
           r"expected a dense one\)$") for kind, make in (("meta", lambda: torch.ones(4, device="meta")),
                                                        ("sparse_coo", lambda: torch.ones(4).to_sparse()))),
    Case("nanogpt-meta-tensor", lambda tmp: nanogpt_raw(tmp, {"model": {"transformer.wte.weight": torch.ones(4, device="meta")},
                                                              "model_args": {}}),
         r"ckpt.pt: .*its tensor model.transformer.wte.weight is a meta tensor; expected a dense one\)$"),
    Case("openai-sae-sparse-tensor", lambda tmp: openai_sae(tmp, torch.ones(4, 4).to_sparse()),
         r"sae.pt: .*its tensor encoder.weight is a sparse_coo tensor; expected a dense one\)?$"),
    Case("nanogpt-out-dir-with-a-fifo", lambda tmp: ["generate", "hi", "-n", "2", "--weights", str(fifo_dir(tmp, "ckpt.pt"))],
         r"/d: no model.safetensors or pytorch_model.bin, but nanoGPT's ckpt.pt: pass the file, .*/d/ckpt.pt$"),
    Case("speculate-config-a-fifo", lambda tmp: ["generate", "hi", "-n", "2", "--weights", str(tmp / "ckpt"),
                                                 "--speculate", str(fifo_dir(tmp, "config.json"))],
         r"speculate: expected 'int4', 'int8', 'ngram' or a GPT-2 checkpoint directory, got '.*/d' \(its config.json "
         r"is a FIFO, not a regular file\)$"),
    Case("nanogpt-model_args-a-list", lambda tmp: nanogpt_raw(tmp, {"model": {}, "model_args": [1, 2]}),
         r"expected nanoGPT's checkpoint \(a dict with 'model' and 'model_args', as its train.py saves\), found a dict "
         r"of 'model': dict, 'model_args': list$"),
    # outputs that are not files (item 3)
    Case("convert-to-a-socket", lambda tmp: ["convert", str(tmp / "ckpt"), str(bound_socket(tmp)), "--to", "gguf"],
         r"s.sock: a socket; expected a file to write \(or a character device or FIFO to write into\)"),
    Case("convert-hf-onto-a-device", lambda tmp: ["convert", str(tmp / "ckpt"), str(null_device(tmp)), "--to", "hf"],
         r"null: a character device; a Hugging Face checkpoint is a directory"),
    Case("convert-gguf-into-a-fifo", lambda tmp: (os.mkfifo(tmp / "pipe"), ["convert", str(tmp / "ckpt"), str(tmp / "pipe"),
                                                                            "--to", "gguf"])[1],
         r"pipe: a FIFO that cannot seek, and gguf-py's writer asks the file for its position to align the tensor data; "
         r"write to a file, then copy it$"),  # refused before it is opened: no reader is needed, none is half-fed
    Case("convert-into-proc", lambda tmp: ["convert", str(tmp / "ckpt"), "/proc/gpt2.gguf", "--to", "gguf"],
         r"cannot write /proc/gpt2.gguf: "),
]


def bound_socket(tmp: Path) -> Path:
    path = tmp / "s.sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(path))  # the file stays after the socket is closed
    s.close()
    return path


def null_device(tmp: Path) -> Path:
    return device(tmp / "null")


@pytest.mark.parametrize("case", CLI_CASES, ids=[c.name for c in CLI_CASES])
def test_a_hostile_file_is_one_line_and_exit_2(case: Case, tiny_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "ckpt").symlink_to(tiny_dir)
    args = case.make(tmp_path)
    one_line_error(*run_cli(args), case.pattern)


# --- the library's corpus ----------------------------------------------------------------------------------------


def saelens_dir(tmp: Path, cfg: dict | str | None = None, **tensors: torch.Tensor) -> Path:
    """A SAELens directory of a standard SAE with d_in 64, d_sae 8 at blocks.0.hook_resid_pre, edited."""
    from safetensors.torch import save_file

    d = tmp / "sae"
    d.mkdir()
    base = {"architecture": "standard", "d_in": 64, "d_sae": 8, "hook_name": "blocks.0.hook_resid_pre",
            "activation_fn": "relu", "apply_b_dec_to_input": True}
    (d / "cfg.json").write_text(cfg if isinstance(cfg, str) else json.dumps({**base, **(cfg or {})}))
    weights = {"W_enc": torch.zeros(64, 8), "W_dec": torch.zeros(8, 64), "b_enc": torch.zeros(8),
               "b_dec": torch.zeros(64), **tensors}
    save_file(weights, str(d / "sae_weights.safetensors"))
    return d


def adapter_dir(tmp: Path, config: str) -> Path:
    d = tmp / "adapter"
    d.mkdir()
    (d / "adapter_config.json").write_text(config)
    return d


def npy_header(path: Path, shape: str) -> None:
    """A .npy file of float32 whose header declares `shape` and which holds no data."""
    header = f"{{'descr': '<f4', 'fortran_order': False, 'shape': {shape}, }}".ljust(117).encode() + b"\n"
    path.write_bytes(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header)


def sae_load(path: Path) -> str:
    return f"from gpt2_engine.interp.sae import SAE; SAE.load({str(path)!r}, hook_name='blocks.0.hook_resid_pre')"


@dataclass(frozen=True)
class CallCase:
    name: str
    make: Callable[[Path], str]  # writes the crafted files, returns the Python statement to run
    exception: str
    pattern: str


CALL_CASES = [
    CallCase("sae-cfg-nested-100000-deep", lambda tmp: sae_load(saelens_dir(tmp, NESTED)), "SAEError",
             r"cfg.json: not valid JSON \(its values nest too deeply\)$"),
    CallCase("sae-d_sae-a-string", lambda tmp: sae_load(saelens_dir(tmp, {"d_sae": "abc"})), "SAEError",
             r"cfg.json: d_sae is 'abc', expected an integer$"),
    CallCase("sae-bool-as-a-string", lambda tmp: sae_load(saelens_dir(tmp, {"apply_b_dec_to_input": "false"})),
             "SAEError", r"cfg.json: apply_b_dec_to_input is 'false', expected true or false$"),
    CallCase("sae-weights-all-nan", lambda tmp: sae_load(saelens_dir(tmp, W_enc=torch.full((64, 8), float("nan")))),
             "SAEError", r"sae_weights.safetensors: W_enc holds 512 NaN/Inf values, expected finite weights$"),
    CallCase("sae-openai-pickle-with-code", lambda tmp: (torch.save({"encoder.weight": Payload()}, tmp / "sae.pt"),
                                                         sae_load(tmp / "sae.pt"))[1],
             "SAEError", r"not a state dict torch can read safely \(its pickle asks for exec, code that "
                         r"loading weights only never runs\)$"),
    CallCase("adapter-config-nested-100000-deep",
             lambda tmp: "from gpt2_engine.formats.peft import load_adapter, recorded_base; from gpt2_engine.core."
                         f"config import GPT2Config; d = {str(adapter_dir(tmp, NESTED))!r}; assert recorded_base(d) == ''; "
                         "load_adapter(d, GPT2Config())",
             "LoraError", r"adapter_config.json: not readable JSON \(its values nest too deeply\)$"),
    CallCase("steering-npy-of-2^40-floats",  # its header's shape against the file's size, before numpy allocates 4 TiB
             lambda tmp: (npy_header(tmp / "v.npy", "(1099511627776,)"),
                          f"from gpt2_engine.formats.vectors import read_vector; read_vector({str(tmp / 'v.npy')!r})")[1],
             "SteeringError", r"v.npy: not a readable .npy file \(mmap length is greater than file size\)$"),
    CallCase("steering-npy-complex",  # the cast to float32 dropped the imaginary part with only a warning
             lambda tmp: (np.save(tmp / "v.npy", np.ones(64, np.complex64)),
                          f"from gpt2_engine.formats.vectors import read_vector; read_vector({str(tmp / 'v.npy')!r})")[1],
             "SteeringError", r"v.npy: expected real numbers, got ndarray of complex64$"),
    CallCase("steering-coef-1e308", lambda tmp: "import torch; from gpt2_engine.interp.steering import Steering; "
                                                "Steering('blocks.0.hook_resid_pre', torch.ones(64), 1e308)",
             "SteeringError", r"steering at blocks.0.hook_resid_pre: coef 1e\+308 adds values up to 1e\+308; at most "
                              r"1e\+12 keeps the model's float32 activations from overflowing into NaN logits$"),
]


@pytest.mark.parametrize("case", CALL_CASES, ids=[c.name for c in CALL_CASES])
def test_a_hostile_file_is_one_exception(case: CallCase, tmp_path: Path) -> None:
    kind, message = run_call(case.make(tmp_path))
    assert kind == case.exception and "\n" not in message and re.search(case.pattern, message), (kind, message)


def test_a_steering_vector_whose_shape_overflows_is_one_line_without_numpys_warning(tiny_dir: Path, tmp_path: Path) -> None:
    npy_header(tmp_path / "v.npy", "(4294967296, 4294967296)")
    one_line_error(*run_cli(["generate", "Hi", "-n", "2", "--weights", str(tiny_dir), "--steer",
                             f"vector={tmp_path / 'v.npy'},hook=blocks.0.hook_resid_pre,coef=1"]),
                   r"v.npy: not a readable .npy file \(array is too big")


# --- token shards (item 6) -----------------------------------------------------------------------------------------


def shard(path: Path, tokens: list[int]) -> Path:
    header = np.zeros(256, dtype="<i4")
    header[:3] = [20240520, 1, len(tokens)]
    path.write_bytes(header.tobytes() + np.asarray(tokens, dtype="<u2").tobytes())
    return path


def test_a_shard_larger_than_the_address_space_is_one_line(tiny_dir: Path, tmp_path: Path) -> None:
    """A sparse shard of 2^31 - 1 tokens (4 GiB) cannot be mapped in a child capped at 3 GiB: one line, not an
    internal error from mmap's ENOMEM."""
    path = shard(tmp_path / "x.bin", [])
    header = np.zeros(256, dtype="<i4")
    header[:3] = [20240520, 1, 2**31 - 1]
    path.write_bytes(header.tobytes())
    os.truncate(path, 1024 + 2 * (2**31 - 1))
    one_line_error(*run_cli(["score", str(path), "--weights", str(tiny_dir)]),
                   r"x.bin: cannot map its 2,147,483,647 tokens \(4.0 GiB\) into memory: more address space than this "
                   r"process may use$")


@pytest.mark.parametrize("tokens, pattern", [
    ([50256, 11, 60000, 12], r"x.bin: token 60000 at position 2 is not a GPT-2 token id \(0..50256\)$"),
    ([], r"nothing to score: every document is empty$"),
], ids=["past-the-vocabulary", "empty"])
def test_a_hostile_shard_is_one_line(tokens: list[int], pattern: str, tiny_dir: Path, tmp_path: Path) -> None:
    one_line_error(*run_cli(["score", str(shard(tmp_path / "x.bin", tokens)), "--weights", str(tiny_dir)]), pattern)


# --- outputs that are not regular files, a full disk, a read-only folder (items 3 and 6) -----------------------------


def test_convert_writes_into_a_device_and_a_fifo_and_replaces_neither(tiny_dir: Path, tmp_path: Path) -> None:
    null, fifo = device(tmp_path / "null"), tmp_path / "pipe"
    os.mkfifo(fifo)
    assert cli("convert", str(tiny_dir), str(tmp_path / "plain.bin"), "--to", "llmc")[0] == 0
    for target in ("gguf", "llmc"):
        code, err = cli("convert", str(tiny_dir), str(null), "--to", target)
        assert code == 0 and stat.S_ISCHR(null.stat().st_mode) and null.stat().st_rdev == os.makedev(1, 3), err
    reader = Reader(fifo)
    code, err = cli("convert", str(tiny_dir), str(fifo), "--to", "llmc")
    assert code == 0, err
    assert reader.result() == (tmp_path / "plain.bin").read_bytes()  # what a file would hold, to the byte
    assert stat.S_ISFIFO(fifo.stat().st_mode) and sorted(os.listdir(tmp_path)) == ["null", "pipe", "plain.bin"]


def test_score_writes_its_outputs_into_a_device_and_a_fifo(tiny_dir: Path, tmp_path: Path) -> None:
    text = tmp_path / "a.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 3)
    null, fifo = device(tmp_path / "null"), tmp_path / "pipe"
    os.mkfifo(fifo)
    code, err = cli("score", str(text), "--weights", str(tiny_dir), "--per-token", str(tmp_path / "plain.jsonl"))
    assert code == 0, err
    reader = Reader(fifo)
    code, err = cli("score", str(text), "--weights", str(tiny_dir), "--output", str(null), "--per-token", str(fifo))
    assert code == 0, err
    assert reader.result() == (tmp_path / "plain.jsonl").read_bytes()
    assert stat.S_ISCHR(null.stat().st_mode) and stat.S_ISFIFO(fifo.stat().st_mode)
    assert sorted(os.listdir(tmp_path)) == ["a.txt", "null", "pipe", "plain.jsonl"]


@pytest.mark.slow
@pytest.mark.long
def test_a_full_disk_is_one_line_for_each_command_and_the_old_files_survive(tiny_dir: Path, tmp_path: Path) -> None:
    text = tmp_path / "a.txt"
    text.write_text("Return the value of the key in the mapping. " * 400)  # 4,000 tokens: 8 KB of shard, 1 MB scored
    with small_disk(tmp_path) as disk:
        (disk / "model.bin").write_bytes(b"old")
        runs = [(["convert", str(tiny_dir), str(disk / "model.bin"), "--to", "llmc", "--overwrite"], disk / "model.bin"),
                (["convert", str(tiny_dir), str(disk / "m.gguf"), "--to", "gguf"], disk / "m.gguf"),  # numpy's tofile
                (["convert", str(tiny_dir), str(disk / "hf"), "--to", "hf"], disk / "hf"),
                (["score", str(text), "--weights", str(tiny_dir), "--per-token", str(disk / "tokens.jsonl")],
                 disk / "tokens.jsonl"),
                (["tokenize", str(tmp_path / "big.txt"), "--out", str(disk / "shards")],
                 disk / "shards" / "shard_000000.bin"),
                (["finetune", str(text), "--weights", str(tiny_dir), "--out", str(disk / "run"), "--steps", "1",
                  "--context", "32", "--batch-size", "2", "--val-fraction", "0.2"], disk / "run")]
        (tmp_path / "big.txt").write_text("Return the value of the key in the mapping. " * 4000)  # 80 KB of shard
        for args, written in runs:
            code, err = cli(*args)
            last = err.rstrip("\n").split("\n")[-1]  # after the progress the command reported before it
            assert code == 2 and "Traceback" not in err and err.count(": error: ") == 1, (args[0], err)
            assert re.fullmatch(rf"gpt2 {args[0]}: error: no space left writing {re.escape(str(written))}\S*", last), err
        assert (disk / "model.bin").read_bytes() == b"old" and not list(disk.rglob("*.part")), list(disk.rglob("*"))
        assert not (disk / "hf").exists()  # a checkpoint folder the failed save made is gone
    code, err = cli("convert", str(tiny_dir), str(device(tmp_path / "full", minor=7)), "--to", "llmc")
    assert (code, err) == (2, f"gpt2 convert: error: no space left writing {tmp_path / 'full'}\n")


def test_a_read_only_destination_is_one_line(tiny_dir: Path, tmp_path: Path) -> None:
    with small_disk(tmp_path, "ro") as disk:
        code, err = cli("convert", str(tiny_dir), str(disk / "model.gguf"), "--to", "gguf")
        assert (code, err) == (2, f"gpt2 convert: error: cannot write {disk / 'model.gguf'}: Read-only file system\n")
        code, err = cli("convert", str(tiny_dir), str(disk / "hf"), "--to", "hf")
        assert (code, err) == (2, f"gpt2 convert: error: cannot write {disk / 'hf'}: Read-only file system\n")


def test_an_llmc_file_is_memory_mapped_as_the_readme_says(tiny_dir: Path, tmp_path: Path) -> None:
    """Its float32 vectors and wte are the file's pages, not copies; only the matrices are copied (transposed into
    Conv1D's layout), and the values are those the file holds."""
    from gpt2_engine.core.config import GPT2Config
    from gpt2_engine.core.pages import file_mapping
    from gpt2_engine.core.weights import named_tensors
    from gpt2_engine.formats.hf import load_weights
    from gpt2_engine.formats.llmc import read_llmc

    assert cli("convert", str(tiny_dir), str(tmp_path / "m.bin"), "--to", "llmc")[0] == 0
    _, tensors = read_llmc(tmp_path / "m.bin")
    for name in ("wte.weight", "wpe.weight", "h.0.ln_1.weight", "h.1.attn.c_attn.bias", "ln_f.bias"):
        assert file_mapping(tensors[name], tmp_path / "m.bin") is not None, name
    assert file_mapping(tensors["h.0.attn.c_attn.weight"], tmp_path / "m.bin") is None
    official = named_tensors(load_weights(tiny_dir, GPT2Config.from_json(tiny_dir / "config.json")))
    assert tensors.keys() == official.keys() and all(torch.equal(tensors[n], t) for n, t in official.items())


# --- the fourth attack: sampling's arithmetic, unbounded reads, files that are not plain tensors ------------------


def test_a_temperature_below_1e_5_is_greedy_and_an_overflowing_penalty_is_refused(capsys, tiny_dir: Path) -> None:
    """--temperature 1e-40 divided the logits into inf ("probability tensor contains inf", an internal error);
    below 1e-5 a draw is greedy, as vLLM reads it. A repetition penalty of 1e-300 overflowed the same way."""
    common = ["-n", "6", "--ignore-eos", "--weights", str(tiny_dir)]
    runs = []
    for temperature in ("0", "1e-40", "5e-324"):
        code, err = cli("generate", "hi", "--temperature", temperature, "--seed", "1", *common)
        runs.append((code, capsys.readouterr().out))
        assert code == 0, err
    assert runs[0] == runs[1] == runs[2] and runs[0][1].strip()
    code, err = cli("generate", "hi", "--repetition-penalty", "1e-300", *common)
    assert code == 2 and err == ("gpt2 generate: error: --repetition-penalty must be in [0.01, 100] (1 disables it), "
                                 "got 1e-300\n")


def test_a_prompt_past_16_mib_is_refused_before_it_is_read(tiny_dir: Path, tmp_path: Path) -> None:
    """A 4 GB sparse prompt file and /dev/zero were read whole (22 GB before the OOM killer); stdin is bounded the
    same way. A corpus document is bounded at 256 MiB."""
    sparse = tmp_path / "sparse.txt"
    with open(sparse, "wb") as f:
        f.truncate(4 << 30)
    for args, found in ((["generate", "-f", str(sparse)], "4.0 GiB"), (["generate", "-f", "/dev/zero"], "more than 16 MiB")):
        one_line_error(*run_cli([*args, "-n", "2", "--weights", str(tiny_dir)]),
                       f": {found}; expected text of at most 16 MiB$")
    with open("/dev/zero", "rb") as zero:
        done = subprocess.run([sys.executable, "-m", "gpt2_engine", "generate", "-", "-n", "2", "--weights",
                               str(tiny_dir)], stdin=zero, capture_output=True, text=True, timeout=TIMEOUT, cwd=ROOT)
    one_line_error(done.returncode, done.stderr, r"stdin: more than 16 MiB; expected text of at most 16 MiB$")
    one_line_error(*run_cli(["score", str(sparse), "--weights", str(tiny_dir)]),
                   r"sparse.txt: 4.0 GiB; expected text of at most 256 MiB; split a corpus into documents "
                   r"\(a .jsonl file, one per line\)$")


@pytest.mark.parametrize("make, pattern", [
    (lambda: torch.ones(64).to_sparse(), r"\(its tensor is a sparse_coo tensor; expected a dense one\)$"),
    (lambda: torch.ones(64, device="meta"), r"\(its tensor is a meta tensor; expected a dense one\)$"),
    (lambda: torch.full((64,), 1e300, dtype=torch.float64), "values up to 1e\\+300 do not fit float32 \\(at most 3.4e38\\)"),
    (lambda: torch.quantize_per_tensor(torch.ones(64), 0.1, 0, torch.qint8), "expected floating-point values, got torch.qint8"),
    (lambda: torch.ones(1).expand(2**40), r"its tensor of shape \[1099511627776\] has 1,099,511,627,776 values "
                                          r"over 1 stored \(an expanded view\); a weights file stores each value"),
], ids=["sparse", "meta", "float64-past-float32", "qint8", "expanded-1.6-KB-of-4-TB"])
def test_a_steering_vector_that_is_not_a_dense_float_tensor_is_one_line(make, pattern: str, tiny_dir: Path,
                                                                        tmp_path: Path) -> None:
    torch.save(make(), tmp_path / "v.pt")
    code, err = run_cli(["generate", "hi", "-n", "2", "--weights", str(tiny_dir), "--steer",
                         f"vector={tmp_path / 'v.pt'},hook=blocks.0.hook_resid_pre,coef=1"])
    one_line_error(code, err, pattern)


def test_an_openai_sae_steers_with_the_hook_given(capsys, trained_dir: Path, saes_dir: Path) -> None:
    """--help offered `sae=` an OpenAI .pt file, which does not record its hook; hook= was refused beside sae=."""
    sae = saes_dir / "openai-topk.pt"
    common = ["-n", "6", "--temperature", "0", "--ignore-eos", "--weights", str(trained_dir)]
    code, err = cli("generate", "The", *common, "--steer", f"sae={sae},feature=1,coef=1")
    assert code == 2 and "OpenAI's format does not record its hook point; add hook=HOOK" in err and err.count("\n") == 1
    steer = f"sae={sae},feature=1,coef=2000,hook=blocks.3.hook_resid_mid"
    code, err = cli("generate", "The", *common, "--steer", steer)
    steered = capsys.readouterr().out
    assert code == 0, err
    code, _ = cli("generate", "The", *common)
    assert code == 0 and capsys.readouterr().out != steered
    code, err = cli("generate", "The", *common, "--steer", f"sae={sae},feature=1,head=2,hook=blocks.3.hook_resid_mid")
    assert code == 2 and err == "gpt2 generate: error: --steer: an SAE steers at its own head; leave out head=\n"


def test_the_command_lines_tolerances_and_sizes_are_bounded(tiny_dir: Path, tmp_path: Path) -> None:
    """compare --rtol nan passed a real mismatch (every comparison with NaN is false); inspect --ig-steps 1e9 took
    16 GB; serve's --api-key "" served without a key, and --prefix-cache-mb inf, --parallel 1e8, --queue-timeout nan
    and --model-name "" were an internal error, a raw OSError or accepted."""
    weights = ["--weights", str(tiny_dir)]
    rtol = "a finite number >= 0 \\(0: the same bits\\)"
    for flag, value, must in (("--rtol", "nan", rtol), ("--rtol", "-1", rtol),
                              ("--min-top1", "2", "a fraction in \\[0, 1\\]"),
                              ("--max-ppl-change", "nan", "a finite number >= 0 \\(a fraction: 0.01 is 1%\\)")):
        one_line_error(*cli("compare", *weights, "--reference", str(tiny_dir), flag, value),
                       f"{flag} must be {must}, got {value}")
    for flag, value, pattern in (
            ("--api-key", "", r"--api-key is empty: give a key, or leave the flag out to serve without one$"),
            ("--prefix-cache-mb", "inf", r"--prefix-cache-mb must be a positive, finite number of MB, got inf"),
            ("--parallel", "100000000", r"--parallel 100,000,000 needs a [\d,.]+ GB KV cache \(\d+ MB a slot\); this "
                                        r"machine has [\d.]+ GB available, room for [\d,]+ slots$"),
            ("--queue-timeout", "nan", r"--queue-timeout must be a positive number of seconds, got nan$"),
            ("--model-name", " ", r"--model-name is empty")):
        one_line_error(*run_cli(["serve", *weights, "--port", "0", flag, value]), pattern)  # bounded, should it serve


# --- the fifth attack -------------------------------------------------------------------------------------------


def test_a_top_p_below_float32s_least_keeps_the_top_token(capsys, tiny_dir: Path) -> None:
    """top_p 1e-300 rounds to 0 in float32, and `above >= p` dropped every token, the top one too (a multinomial of
    zeros: an internal error, a 500); the top token always stays, so it is greedy's."""
    common = ["-n", "5", "--ignore-eos", "--seed", "3", "--weights", str(tiny_dir)]
    outs = []
    for args in (["--top-p", "1e-300"], ["--top-p", "5e-324", "--top-k", "1"], ["--temperature", "0"]):
        code, err = cli("generate", "hi", *args, *common)
        outs.append(capsys.readouterr().out)
        assert code == 0, err
    assert outs[0] == outs[1] == outs[2]


def test_a_nested_steering_vector_and_a_range_past_the_model_are_one_line(tiny_dir: Path, tmp_path: Path) -> None:
    """A nested tensor passed the layout check (an internal error in torch); --layers 0-99999999999 was expanded
    into a list before it was bounded (a MemoryError, or the OOM killer)."""
    torch.save(torch.nested.nested_tensor([torch.ones(64)]), tmp_path / "v.pt")
    one_line_error(*run_cli(["generate", "hi", "-n", "2", "--weights", str(tiny_dir), "--steer",
                             f"vector={tmp_path / 'v.pt'},hook=blocks.0.hook_resid_pre,coef=1"]),
                   r"\(its tensor is a nested tensor; expected a dense one\)$")
    one_line_error(*run_cli(["inspect", "hi there", "--weights", str(tiny_dir), "--layers", "0-99999999999",
                             "--out", str(tmp_path / "o"), "--quiet"]),
                   r"--layers '0-99999999999': this model's layers are 0..1$")


def test_a_prefix_cache_past_memory_and_an_unbounded_key_file_are_one_line(tiny_dir: Path, tmp_path: Path) -> None:
    """--prefix-cache-mb 1e300 overflowed torch.empty (serve: a 346-character C++ message; eval: an internal error);
    --api-key-file /dev/zero was read whole (5 GB, then a MemoryError)."""
    weights = ["--weights", str(tiny_dir)]
    one_line_error(*run_cli(["serve", *weights, "--port", "0", "--prefix-cache-mb", "1e300"]),
                   r"--prefix-cache-mb 1e\+300 MB: expected a positive size within the [\d,]+ MB of memory this "
                   r"process has available$")
    one_line_error(*run_cli(["serve", *weights, "--port", "0", "--api-key-file", "/dev/zero"]),
                   r"/dev/zero: more than 4,096 bytes; expected one line holding the key$")
    one_line_error(*run_cli(["serve", *weights, "--port", "0", "--api-key", "a\nb"]),
                   r"the API key holds a newline or another unprintable character; expected one line of text$")


def test_a_document_too_large_to_tokenize_is_one_line(tiny_dir: Path, tmp_path: Path) -> None:
    """A 200 MB run of one character is one piece for GPT-2's BPE: tiktoken asked for 6.7 GB and aborted the process
    (a Rust backtrace). Under a 3 GB address space it is refused before it is tokenized."""
    run = tmp_path / "run.txt"
    with open(run, "wb") as f:
        f.truncate(200 << 20)
    one_line_error(*run_cli(["score", str(run), "--weights", str(tiny_dir)]),
                   r"run.txt: 200 MiB of text may need 13.4 GB to tokenize \(a run without spaces is one piece\); this "
                   r"process has [\d.]+ GB available: split it into documents")


@pytest.mark.parametrize("name, line", [("run.txt", "a" * 30_000_000), ("run.jsonl", json.dumps({"text": "a" * 30_000_000}))])
def test_a_document_that_fits_the_address_space_limit_but_not_what_is_left_of_it_is_one_line(
        name: str, line: str, tiny_dir: Path, tmp_path: Path) -> None:
    """Under an address-space limit the BPE's estimate was checked against the whole limit, not what is left of it
    after torch and the interpreter (about 0.9 GB here): a 30 MB run under 2 GiB passed the check, then tiktoken
    aborted the process (rc 134, a Rust backtrace); so did a .jsonl line of the same text."""
    (tmp_path / name).write_text(line)
    one_line_error(*run_cli(["score", str(tmp_path / name), "--weights", str(tiny_dir)], memory=2 << 30),
                   rf"{name}(:1)?: 29 MiB of text may need 1.9 GB to tokenize \(a run without spaces is one piece\); "
                   r"this process has [\d.]+ GB available: split it into documents")


@pytest.mark.parametrize("name, text, pattern", [
    ("huge", "{{ 'x' * 4000000000 }}", r"'\*' would make 4,000,000,000 characters or items; at most 1,048,576"),
    ("loop", "{% for i in range(100000000) %}x{% endfor %}", r"failed: OverflowError: Range too big"),
    ("recursion", "{% macro f(n) %}{{ f(n+1) }}{% endmacro %}{{ f(0) }}", r"failed: RecursionError"),
    ("doubling", "{% set s = namespace(x='ab') %}{% for i in range(40) %}{% set s.x = s.x ~ s.x %}{% endfor %}"
                 "{{ s.x|length }}", r"failed: MemoryError"),
], ids=["huge", "loop", "recursion", "doubling"])
def test_a_chat_template_that_fails_on_any_conversation_is_refused_at_startup(name: str, text: str, pattern: str,
                                                                              tiny_dir: Path, tmp_path: Path) -> None:
    """Rendered once at startup in a child of bounded memory and time: a constant folded to 4 GB at compile (an
    internal error at startup), a loop past the sandbox's range, endless recursion and a doubled string (500s at every
    chat request, the last holding 2.4 GB of the server and its event loop for seconds)."""
    (tmp_path / "t.jinja").write_text(text)
    one_line_error(*run_cli(["serve", "--weights", str(tiny_dir), "--port", "0", "--chat-template",
                             str(tmp_path / "t.jinja")]), pattern)


TASK = "task: evil\ndataset_path: json\n"
CODE = (r"a task file is code to lm-eval \(it renders the file's Jinja templates unsandboxed, loads metrics by path and "
        r"imports !function modules\); pass --trust-task-code if you trust (it|the files there)$")


def task_files(files: dict[str, str | bytes]) -> Callable[[Path], list[str]]:
    """Writes `files` (relative path: text or bytes) and evil.py beside each YAML; the arguments name the first."""
    def make(tmp: Path) -> list[str]:
        for name, data in files.items():
            path = tmp / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data if isinstance(data, bytes) else data.encode())
            (path.parent / "evil.py").write_text(f"open({str(tmp / 'ran')!r}, 'w').close()\ndef f(doc):\n    return ''\n")
        return ["--tasks", str(tmp / next(iter(files)))]
    return make


def in_include_path(tmp: Path) -> list[str]:
    task_files({"tasks/sub/evil.yaml": TASK + "doc_to_text: !function evil.f\n"})(tmp)
    return ["--tasks", "evil", "--include-path", str(tmp / "tasks")]


def task_folder(tmp: Path) -> list[str]:
    task_files({"tasks/evil.yaml": TASK + JINJA})(tmp)
    return ["--tasks", str(tmp / "tasks")]


JINJA = "doc_to_text: \"{{ cycler.__init__.__globals__.os.popen('touch ran') }}\"\n"


@pytest.mark.parametrize("make", [
    task_files({"evil.yaml": TASK + "doc_to_text: !function evil.f\n"}),
    # a byte search for "!function" missed a %TAG handle, a URI-escaped verbatim tag, an include and UTF-16; a parse
    # of the YAML missed lm-eval's unsandboxed Jinja and metrics loaded by path: every task file is code to lm-eval
    task_files({"evil.yaml": "%TAG !f! !fun\n---\n" + TASK + "doc_to_text: !f!ction evil.f\n"}),
    task_files({"a/evil.yaml": "include: ../b/base.yaml\ntask: evil\n", "b/base.yaml": TASK + "doc_to_text: !function evil.f\n"}),
    task_files({"evil.yaml": (TASK + "doc_to_text: !function evil.f\n").encode("utf-16")}),
    task_files({"evil.yaml": TASK + JINJA}),
    task_files({"evil.yaml": TASK + "metric_list:\n  - metric: evil.py\n"}),
    task_files({"evil.txt": TASK + "doc_to_text: !function evil.f\n"}),  # lm-eval reads any existing path as YAML
    task_folder,
    in_include_path,
], ids=["function-tag", "tag-directive", "include", "utf-16", "jinja", "metric-by-path", "any-suffix", "folder",
        "include-path"])
def test_a_task_file_runs_only_with_trust_task_code(make: Callable[[Path], list[str]], tiny_dir: Path,
                                                    tmp_path: Path) -> None:
    """lm-eval runs what a task file says: `!function` imports the module beside it, its Jinja templates render
    unsandboxed (`cycler.__init__.__globals__.os`), a metric named by path is imported by `evaluate`. `gpt2 eval` ran
    them (a file from elsewhere running code); a task given as a file or folder, and --include-path, now need
    --trust-task-code, and only lm-eval's own tasks run without it."""
    pytest.importorskip("lm_eval")
    one_line_error(*run_cli(["eval", *make(tmp_path), "--weights", str(tiny_dir)]), CODE)
    assert not (tmp_path / "ran").exists()


@pytest.mark.long
def test_a_trusted_task_with_an_unknown_metric_is_one_line_naming_the_registry(tiny_dir: Path,
                                                                               tmp_path: Path) -> None:
    """lm-eval looks up an unknown metric's aggregation, finds None, and raises KeyError(None): that was quoted as
    `--tasks: None`, naming nothing."""
    pytest.importorskip("lm_eval")
    (tmp_path / "d.jsonl").write_text('{"q": "a b", "a": " c"}\n')
    (tmp_path / "t.yaml").write_text(
        f"task: t_unknown_metric\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {tmp_path / 'd.jsonl'}\n"
        "test_split: test\noutput_type: loglikelihood\ndoc_to_text: '{{q}}'\ndoc_to_target: '{{a}}'\n"
        "metric_list:\n  - metric: no_such_metric_anywhere\n")
    code, err = run_cli(["eval", "--tasks", str(tmp_path / "t.yaml"), "--trust-task-code", "--weights", str(tiny_dir)])
    assert code == 2
    assert err.splitlines()[-1] == (
        "gpt2 eval: error: --tasks: lm-eval could not build the task (it looked up None in a registry: a metric, "
        "filter or output_type the task's YAML names that lm-eval does not know?)")


ROWS = '{"q": "a b", "a": " c"}\n'
TASK_KEYS = "test_split: test\noutput_type: loglikelihood\ndoc_to_text: '{{q}}'\ndoc_to_target: '{{a}}'\n"


def data_task(tmp: Path, data: str) -> Path:
    """d.jsonl and data/d.jsonl (one row each), and t.yaml, task t_data, reading them as `data` says ({d}: tmp)."""
    (tmp / "data").mkdir()
    for path in (tmp / "d.jsonl", tmp / "data" / "d.jsonl"):
        path.write_text(ROWS)
    (tmp / "t.yaml").write_text("task: t_data\n" + data.format(d=tmp) + TASK_KEYS)
    return tmp / "t.yaml"


FILES = "dataset_path: json\ndataset_kwargs:\n  data_files:\n"


@pytest.mark.parametrize("data, output, said", [
    (FILES + "    test: {d}/d.jsonl\n", "d.jsonl", "is {d}/d.jsonl, one of the inputs (task t_data's data_files), "
                                                   "which writing would replace"),
    (FILES + "    - {d}/d.jsonl\n", "d.jsonl", "is {d}/d.jsonl, one of the inputs (task t_data's data_files), "
                                               "which writing would replace"),
    (FILES + "    test: [{d}/*.jsonl]\n", "new.jsonl", "matches {d}/*.jsonl, one of the inputs (task t_data's "
                                                       "data_files)"),
    ("dataset_path: json\ndataset_kwargs:\n  data_dir: {d}/data\n  data_files: d.jsonl\n", "data/results.json",
     "is in {d}/data, one of the inputs (task t_data's data_dir), which the results would join"),
    ("dataset_path: {d}/data\n", "data/results.json",
     "is in {d}/data, one of the inputs (task t_data's dataset_path), which the results would join"),
    ("include: base.yaml\n", "d.jsonl", "is {d}/d.jsonl, one of the inputs (task t_data's data_files), which "
                                        "writing would replace"),
    ("include: base.yaml\n", "base.yaml", "is {d}/base.yaml, one of the inputs (included by {d}/t.yaml), which "
                                          "writing would replace"),
], ids=["data-files", "data-files-list", "data-files-pattern", "data-dir", "dataset-path-folder", "in-an-include",
        "the-include"])
def test_eval_output_never_replaces_or_joins_a_tasks_data(data: str, output: str, said: str, tiny_dir: Path,
                                                          tmp_path: Path) -> None:
    """`--output D` where D is the task's own data_files exited 0 and replaced the rows with lm-eval's results JSON
    (the next run: 'q' is undefined); the files and folders a trusted task reads (through its includes too) are
    inputs like the model's, refused before the run."""
    pytest.importorskip("lm_eval")
    (tmp_path / "base.yaml").write_text(FILES.format(d=tmp_path) + f"    test: {tmp_path / 'd.jsonl'}\n")
    task = data_task(tmp_path, data)
    code, err = run_cli(["eval", "--tasks", str(task), "--trust-task-code", "--weights", str(tiny_dir), "--output",
                         str(tmp_path / output)])
    assert (code, err.strip().splitlines()) == (2, [
        f"gpt2 eval: error: --output {tmp_path / output}: {said.format(d=tmp_path)}; write the results somewhere else"])
    assert (tmp_path / "d.jsonl").read_text() == (tmp_path / "data" / "d.jsonl").read_text() == ROWS
    assert not (tmp_path / "data" / "results.json").exists() and not (tmp_path / "new.jsonl").exists()


def inline_task(data: str) -> str:
    """Task tn as a flow mapping inside a group's task list, reading its data as `data` says."""
    return "{task: tn, test_split: test, output_type: loglikelihood, doc_to_text: '{{q}}', doc_to_target: '{{a}}'" + data + "}"


DATA = ", dataset_path: json, dataset_kwargs: {data_files: {test: {d}/d.jsonl}}"  # {d}: the test's folder


@pytest.mark.parametrize("group", [
    "{group: gn, task: [{group: inner, task: [" + inline_task(DATA) + "]}]}\n",
    "{group: gn, task: [{group: inner" + DATA + ", task: [" + inline_task("") + "]}]}\n",
    "{group: gn" + DATA + ", task: [{group: inner, task: [{group: deeper, task: [" + inline_task("") + "]}]}]}\n",
], ids=["in-the-task", "from-the-inner-group", "from-the-outer-group"])
def test_eval_output_never_replaces_the_data_of_a_task_in_a_nested_group(group: str, tiny_dir: Path,
                                                                         tmp_path: Path) -> None:
    """A task defined inline in a group inside a group (`task: [{group: inner, task: [{task: tn, ...}]}]`) had its
    data_files replaced by `--output` (exit 0): the walk looked one level deep. Every level is walked now, with the
    keys each group passes down to its tasks."""
    pytest.importorskip("lm_eval")
    (tmp_path / "inc").mkdir()
    (tmp_path / "inc" / "g.yaml").write_text(group.replace("{d}", str(tmp_path)))
    (tmp_path / "d.jsonl").write_text(ROWS)
    code, err = run_cli(["eval", "--tasks", "gn", "--include-path", str(tmp_path / "inc"), "--trust-task-code",
                         "--weights", str(tiny_dir), "--output", str(tmp_path / "d.jsonl")])
    assert (code, err.strip().splitlines()) == (2, [
        f"gpt2 eval: error: --output {tmp_path / 'd.jsonl'}: is {tmp_path / 'd.jsonl'}, one of the inputs (task tn's "
        "data_files), which writing would replace; write the results somewhere else"])
    assert (tmp_path / "d.jsonl").read_text() == ROWS


def test_a_group_nested_past_32_inline_levels_is_one_line(tiny_dir: Path, tmp_path: Path) -> None:
    """The walk of inline groups is bounded: a file nesting them 33 deep is refused, not recursed into."""
    pytest.importorskip("lm_eval")
    (tmp_path / "inc").mkdir()
    group = inline_task("")
    for depth in range(33):
        group = f"{{group: g{depth}, task: [{group}]}}"
    (tmp_path / "inc" / "g.yaml").write_text(f"group: gn\ntask: [{group}]\n")
    code, err = run_cli(["eval", "--tasks", "gn", "--include-path", str(tmp_path / "inc"), "--trust-task-code",
                         "--weights", str(tiny_dir)])
    assert (code, err.strip().splitlines()) == (2, [
        f"gpt2 eval: error: --include-path {tmp_path / 'inc' / 'g.yaml'}: its groups nest inline more than 32 deep; "
        "expected a few levels"])


@pytest.mark.parametrize("output, said", [
    ("inc/g.yaml", "is {d}/inc/g.yaml, one of the inputs (a task file in --include-path {d}/inc), which writing would "
                   "replace"),
    ("elsewhere.yaml", "is {d}/inc/link.yaml, one of the inputs (a task file in --include-path {d}/inc), which "
                       "writing would replace"),
    ("inc/results.json", "is in {d}/inc, the --include-path folder, whose YAML files lm-eval reads"),
    ("inc/sub/results.yaml", "is in {d}/inc, the --include-path folder, whose YAML files lm-eval reads"),
], ids=["a-task-file", "a-task-file-linked-in", "a-new-file", "in-a-subfolder"])
def test_eval_output_never_replaces_or_joins_the_include_path(output: str, said: str, tiny_dir: Path,
                                                              tmp_path: Path) -> None:
    """`--output DIR/g.yaml` replaced the user's group file in --include-path with the results JSON (exit 0), though
    lm-eval indexed it in that very run; every task file there is an input, and the folder itself is no place for
    results (the next run indexes them, and a .yaml name makes them a task)."""
    pytest.importorskip("lm_eval")
    (tmp_path / "inc" / "sub").mkdir(parents=True)
    task = ("group: gn\ntask: [" + inline_task(DATA) + "]\n").replace("{d}", str(tmp_path))
    (tmp_path / "inc" / "g.yaml").write_text(task)
    (tmp_path / "elsewhere.yaml").write_text("task: te\n" + TASK_KEYS)
    (tmp_path / "inc" / "link.yaml").symlink_to(tmp_path / "elsewhere.yaml")
    (tmp_path / "d.jsonl").write_text(ROWS)
    code, err = run_cli(["eval", "--tasks", "gn", "--include-path", str(tmp_path / "inc"), "--trust-task-code",
                         "--weights", str(tiny_dir), "--output", str(tmp_path / output)])
    assert (code, err.strip().splitlines()) == (2, [
        f"gpt2 eval: error: --output {tmp_path / output}: {said.format(d=tmp_path)}; write the results somewhere else"])
    assert (tmp_path / "inc" / "g.yaml").read_text() == task
    assert sorted(p.name for p in (tmp_path / "inc").rglob("*")) == ["g.yaml", "link.yaml", "sub"]


def zero_include(tmp: Path) -> str:
    return "/dev/zero"


def fifo_include(tmp: Path) -> str:
    os.mkfifo(tmp / "fifo.yaml")
    return "fifo.yaml"


def looped_include(tmp: Path) -> str:
    (tmp / "ll.yaml").symlink_to("ll2.yaml")
    (tmp / "ll2.yaml").symlink_to("ll.yaml")
    return "ll.yaml"


def not_yaml_include(tmp: Path) -> str:
    (tmp / "bad.yaml").write_text("doc_to_text: [unclosed\n")
    return "bad.yaml"


def cyclic_include(tmp: Path) -> str:
    (tmp / "a.yaml").write_text("include: b.yaml\n")
    (tmp / "b.yaml").write_text("include: a.yaml\n")
    return "a.yaml"


@pytest.mark.parametrize("make, said", [
    (fifo_include, "include fifo.yaml: a FIFO; expected a task YAML file"),
    (zero_include, "include /dev/zero: a character device; expected a task YAML file"),
    (looped_include, "include ll.yaml: a symlink loop"),
    (not_yaml_include, "include bad.yaml: not a task YAML file (while parsing a flow sequence in \"bad.yaml\", line "
                       "1, column 14 did not find expected ',' or ']' in \"bad.yaml\", line 2, column 1)"),
    (cyclic_include, "include a.yaml: {d}/a.yaml is read already for this task (an include cycle?); include it once"),
], ids=["fifo", "dev-zero", "symlink-loop", "not-yaml", "cycle"])
def test_a_trusted_tasks_bad_include_is_one_line_naming_it(make: Callable[[Path], str], said: str, tiny_dir: Path,
                                                           tmp_path: Path) -> None:
    """Trusting a task's code is not accepting a hang (lm-eval opened a FIFO include and waited for a writer) or an
    'internal error' (ReaderError from /dev/zero, RuntimeError from a symlink loop) for a mistake in a task file:
    every include is looked at before lm-eval opens it. Without --trust-task-code the trust check refuses it first."""
    pytest.importorskip("lm_eval")
    task = data_task(tmp_path, f"include: {make(tmp_path)}\n" + FILES + "    test: {d}/d.jsonl\n")
    args = ["eval", "--tasks", str(task), "--weights", str(tiny_dir)]
    code, err = run_cli([*args, "--trust-task-code"])
    assert (code, err.strip().splitlines()) == (2, [f"gpt2 eval: error: {said.format(d=tmp_path)}"])
    one_line_error(*run_cli(args), CODE)


def test_a_fifo_task_file_is_named_as_one(tiny_dir: Path, tmp_path: Path) -> None:
    """A FIFO given as the task file was described as missing ('no such task file')."""
    pytest.importorskip("lm_eval")
    os.mkfifo(tmp_path / "fifo.yaml")
    code, err = run_cli(["eval", "--tasks", str(tmp_path / "fifo.yaml"), "--weights", str(tiny_dir)])
    assert (code, err.strip().splitlines()) == (
        2, [f"gpt2 eval: error: --tasks {tmp_path / 'fifo.yaml'}: a FIFO, not a task YAML file"])


def test_a_template_naming_a_field_the_rows_lack_is_one_line(tiny_dir: Path, tmp_path: Path) -> None:
    """`doc_to_text: '{{q}}'` over rows without `q` was 'internal error: UndefinedError: 'q' is undefined'."""
    pytest.importorskip("lm_eval")
    task = data_task(tmp_path, FILES + "    test: {d}/d.jsonl\n")
    (tmp_path / "d.jsonl").write_text('{"p": "a b", "a": " c"}\n')
    code, err = run_cli(["eval", "--tasks", str(task), "--trust-task-code", "--weights", str(tiny_dir)])
    assert code == 2
    assert err.splitlines()[-1] == ("gpt2 eval: error: --tasks: a task's template names 'q', which its data rows do "
                                    "not have (jinja2: 'q' is undefined)")
    task.write_text(task.read_text().replace("test_split: test\n", ""))  # lm-eval finds no split to test on
    code, err = run_cli(["eval", "--tasks", str(task), "--trust-task-code", "--weights", str(tiny_dir)])
    assert code == 2
    assert re.fullmatch(r"gpt2 eval: error: --tasks: lm-eval failed on the task file \(ValueError: Task dataset .*\); check "
                        r"its keys against lm-eval's task guide", err.splitlines()[-1]), err


@pytest.mark.parametrize("kwargs, message", [
    ({"until": 5}, "until is 5; expected a string or a list of strings"),
    ({"max_gen_toks": "abc"}, "max_gen_toks is 'abc'; expected a positive integer"),
    ({"max_new_tokens": 0}, "max_gen_toks is 0; expected a positive integer"),
    ({"max_gen_toks": 10**8}, "max_gen_toks is 100,000,000; expected fewer than the context of 1,024 tokens, which the "
                              "prompt shares"),  # failed mid-run, the task unnamed
    ({"num_beams": 4}, "num_beams other than 1; the engine does not run beam search"),
    ({"do_sample": "yes"}, "do_sample is 'yes'; expected true or false"),
    ({"penalty_alpha": 0.6}, "penalty_alpha: not run by the engine; expected until, max_gen_toks"),
    ({"do_sample": True, "top_p": 2}, "top_p must be in (0, 1] (1 disables it), got 2"),
    ({"temperature": float("nan")}, "temperature must be in [0, "),
])
def test_a_tasks_generation_kwargs_are_checked_by_name(kwargs: dict, message: str) -> None:
    """A task's generation_kwargs reach the engine's lm-eval model: a wrong type was a ValueError from int() or
    lm-eval's helpers, and an option the engine does not run its own plain ValueError, each an internal error."""
    pytest.importorskip("lm_eval")
    from gpt2_engine.core.errors import GenerationError

    with pytest.raises(GenerationError, match="^the task's generation_kwargs: " + re.escape(message)):
        run_settings(kwargs)


def run_settings(kwargs: dict) -> None:
    """EngineLM._settings on `kwargs`, without a model (it reads only its own max_gen_toks, seed and steering)."""
    from gpt2_engine.harness import EngineLM

    lm = EngineLM.__new__(EngineLM)
    lm.max_gen_toks, lm.seed, lm.steering, lm.max_length = 256, 0, (), 1024
    lm._settings(dict(kwargs), "<|endoftext|>")


def test_a_tasks_max_new_tokens_is_honoured_and_a_bad_key_is_one_line(tiny_dir: Path, tmp_path: Path) -> None:
    """lm-eval's own tasks (terretaqa, norrewrite_instruct) set hf's max_new_tokens and num_beams 1: both are run
    as hf runs them; a key the engine does not run is one line, exit 2."""
    pytest.importorskip("lm_eval")
    from gpt2_engine.harness import GENERATION_KWARGS, EngineLM

    lm = EngineLM.__new__(EngineLM)
    lm.max_gen_toks, lm.seed, lm.steering, lm.max_length = 256, 0, (), 1024
    settings, until = lm._settings({"until": ["\n"], "max_new_tokens": 150, "num_beams": 1}, "<|endoftext|>")
    assert settings.max_new_tokens == 150 and settings.sampling.greedy and until == ["\n", "<|endoftext|>"]
    task = data_task(tmp_path, FILES + "    test: {d}/d.jsonl\n")
    task.write_text(task.read_text().replace("output_type: loglikelihood", "output_type: generate_until")
                    + "generation_kwargs:\n  until: ['\\n']\n  penalty_alpha: 0.6\n")
    code, err = run_cli(["eval", "--tasks", str(task), "--trust-task-code", "--weights", str(tiny_dir)])
    assert (code, err.splitlines()[-1]) == (2, "gpt2 eval: error: task 't_data' generation_kwargs: penalty_alpha: not "
                                               f"run by the engine; expected {GENERATION_KWARGS}")
    # a value the sampler refuses names the task too: it came from the file, not from a flag (top_p 2 was unplaced)
    task.write_text(task.read_text().replace("  penalty_alpha: 0.6\n", "  do_sample: true\n  top_p: 2\n"))
    code, err = run_cli(["eval", "--tasks", str(task), "--trust-task-code", "--weights", str(tiny_dir)])
    assert (code, err.splitlines()[-1]) == (2, "gpt2 eval: error: task 't_data' generation_kwargs: top_p must be in "
                                               "(0, 1] (1 disables it), got 2")


def test_finetune_log_is_never_one_of_its_inputs(tiny_dir: Path, tmp_path: Path) -> None:
    """--log appended JSON lines into whatever it named: the checkpoint's config.json (every later command on it
    failed) or the training text (trained on next time)."""
    shutil.copytree(tiny_dir, tmp_path / "w")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("Some text to train on. " * 20)
    before = {p: p.read_bytes() for p in [tmp_path / "w" / "config.json", tmp_path / "notes" / "a.txt"]}
    run = ["finetune", str(tmp_path / "notes"), "--weights", str(tmp_path / "w"), "--out", str(tmp_path / "out"),
           "--steps", "1", "--context", "16", "--log"]
    for log, said in [(tmp_path / "w" / "config.json", f"is {tmp_path / 'w' / 'config.json'}, one of the inputs (a "
                                                        "file of the --weights checkpoint), which writing would replace"),
                      (tmp_path / "notes" / "a.txt", f"is in {tmp_path / 'notes'}, a DATA folder whose files are read "
                                                     "as training text"),
                      (tmp_path / "notes" / "log.jsonl", f"is in {tmp_path / 'notes'}, a DATA folder")]:
        one_line_error(*run_cli([*run, str(log)]), re.escape(f"--log {log}: {said}"))
    assert all(p.read_bytes() == data for p, data in before.items()) and not (tmp_path / "out").exists()
    init = tmp_path / "init.json"  # the --init config and the resume state: the next run failed on them
    init.write_text((tiny_dir / "config.json").read_text())
    one_line_error(*run_cli(["finetune", str(tmp_path / "notes"), "--init", str(init), "--out", str(tmp_path / "o2"),
                             "--steps", "1", "--context", "16", "--log", str(init)]),
                   re.escape(f"--log {init}: is {init}, one of the inputs (the --init config)"))
    (tmp_path / "out" / "last").mkdir(parents=True)
    (tmp_path / "out" / "last" / "trainer_state.json").write_text("{}")
    state = tmp_path / "out" / "last" / "trainer_state.json"
    one_line_error(*run_cli([*run, str(state), "--resume"]),
                   re.escape(f"--log {state}: is {state}, one of the inputs (a file of the run's resume state)"))
    code, err = run_cli([*run[:-1], "--out", str(tmp_path / "o3"), "--log", "/dev/full"])  # named as the log's, not --out's
    assert (code, err.splitlines()[-1]) == (2, "gpt2 finetune: error: --log /dev/full: cannot write (No space left on "
                                               "device)")


def test_finetune_log_is_never_a_file_the_run_saves(tiny_dir: Path, tmp_path: Path) -> None:
    """`--overwrite --log OUT/config.json` exited 0 with the log gone: the save replaced it. A file or folder the run
    writes into --out is refused, whether it exists yet or not, before anything is written."""
    (tmp_path / "a.txt").write_text("Some text to train on. " * 20)
    out = tmp_path / "out"
    run = ["finetune", str(tmp_path / "a.txt"), "--weights", str(tiny_dir), "--out", str(out), "--steps", "1",
           "--context", "16", "--overwrite"]
    for name in ["config.json", "model.safetensors", "merges.txt", "adapter_config.json"]:
        code, err = run_cli([*run, "--log", str(out / name)])
        assert (code, err.strip()) == (2, f"gpt2 finetune: error: --log {out / name}: is {name} in --out {out}, a file "
                                          "of the checkpoint the run saves there, which replaces the log; write the log "
                                          "somewhere else")
    code, err = run_cli([*run, "--log", str(out / "last" / "log.jsonl")])
    assert (code, err.strip()) == (2, f"gpt2 finetune: error: --log {out / 'last' / 'log.jsonl'}: is in {out / 'last'}, "
                                      "the run's resume state, which the run replaces whole; write the log somewhere "
                                      "else")
    code, err = run_cli([*run, "--lora", "4", "--merge", "--log", str(out / "merged" / "log.jsonl")])
    assert (code, err.strip()) == (2, f"gpt2 finetune: error: --log {out / 'merged' / 'log.jsonl'}: is in "
                                      f"{out / 'merged'}, --merge's checkpoint, which the run replaces whole; write the "
                                      "log somewhere else")
    assert not out.exists()


def sparse(path: Path, size: int = 5 << 30) -> Path:
    """`path` replaced by a sparse file of `size` bytes (5 GiB: no disk, and nothing a reader may read whole)."""
    path.unlink(missing_ok=True)
    path.touch()
    os.truncate(path, size)
    return path


def checkpoint_with(name: str) -> Callable[[Path, Path], tuple[list[str], Path]]:
    def make(tiny_dir: Path, tmp: Path) -> tuple[list[str], Path]:
        shutil.copytree(tiny_dir, tmp / "ckpt")
        return ["generate", "hi", "-n", "2", "--weights", str(tmp / "ckpt")], sparse(tmp / "ckpt" / name)
    return make


def sae_with_huge_cfg(tiny_dir: Path, tmp: Path) -> tuple[list[str], Path]:
    d = saelens_dir(tmp)
    return ["sae", "features", "hi", "--sae", str(d), "--weights", str(tiny_dir)], sparse(d / "cfg.json")


def adapter_with_huge_config(tiny_dir: Path, tmp: Path) -> tuple[list[str], Path]:
    d = adapter_dir(tmp, "{}")
    return ["generate", "hi", "-n", "2", "--weights", str(tiny_dir), "--lora", str(d)], sparse(d / "adapter_config.json")


@pytest.mark.parametrize("make, expected", [
    (checkpoint_with("config.json"), "a JSON config"),
    (checkpoint_with("vocab.json"), "GPT-2's BPE vocabulary file"),
    (checkpoint_with("merges.txt"), "GPT-2's BPE merges file"),
    (sae_with_huge_cfg, "a JSON config"),
    (adapter_with_huge_config, "a PEFT adapter config"),
], ids=["config.json", "vocab.json", "merges.txt", "sae-cfg.json", "adapter_config.json"])
def test_a_metadata_file_past_64_mib_is_refused_before_it_is_read(make: Callable, expected: str, tiny_dir: Path,
                                                                  tmp_path: Path) -> None:
    """A 5 GiB sparse config.json, vocab.json, merges.txt, SAE cfg.json or adapter_config.json was read whole (an
    internal MemoryError at 5.5 GB under a cap; without one, until the machine ran out): each is a few KB to 1 MB,
    and one past 64 MiB is refused by its size before any of it is read."""
    args, path = make(tiny_dir, tmp_path)
    one_line_error(*run_cli(args), f"error: {re.escape(str(path))}: 5.0 GiB; expected {re.escape(expected)} of at "
                                   f"most 64 MiB$")


# --- the command line's bounds: what ran out of memory as an internal error ----------------------------------------


def test_a_batch_or_prefix_cache_larger_than_memory_is_one_line(tiny_dir: Path, tmp_path: Path) -> None:
    text = tmp_path / "a.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    score = ["score", str(text), "--weights", str(tiny_dir)]
    one_line_error(*run_cli([*score, "--batch-size", "1000000", "--stride", "1"]),
                   r"--batch-size 1000000 x --context \d+ needs ~[\d,.]+ GB for a forward pass's activations; this "
                   r"process has [\d.]+ GB available: at most --batch-size \d+ fits$")
    one_line_error(*run_cli([*score, "--prefix-cache-mb", "1e12"]),
                   r"--prefix-cache-mb 1e\+12 MB: expected a positive size within the [\d,]+ MB of memory this process "
                   r"has available$")


def test_an_sae_batch_larger_than_memory_is_one_line(trained_dir: Path, saes_dir: Path, tmp_path: Path) -> None:
    """gpt2 sae eval and dashboard check a batch's activations and latents against memory as score does (eval's
    --batch-size 1000000 was an internal error from torch's allocator)."""
    text = tmp_path / "a.txt"
    text.write_text("Return the number of items in the list. " * 40_000)  # 360,000 tokens: 703 windows of 512
    common = ["--sae", str(saes_dir / "standard-resid"), "--weights", str(trained_dir), "--context", "512",
              "--batch-size", "1000000", "--quiet"]
    needs = (r"--batch-size \d+ x --context 512 needs ~[\d,.]+ GB for a forward pass's activations; this process has "
             r"[\d.]+ GB available: at most --batch-size \d+ fits$")
    one_line_error(*run_cli(["sae", "eval", str(text), "--max-windows", "100000", *common]), needs)
    one_line_error(*run_cli(["sae", "dashboard", str(text), "--out", str(tmp_path / "d"), *common]), needs)


def test_more_threads_than_four_a_core_is_refused_by_the_parser(tiny_dir: Path) -> None:
    cores = os.cpu_count() or 1
    for command in (["generate", "hi", "-n", "2"], ["finetune", "x.txt", "--out", "run"]):
        code, err = run_cli([*command, "--threads", "1000000", "--weights", str(tiny_dir)])
        assert code == 2 and err.splitlines()[-1] == (
            f"gpt2 {command[0]}: error: argument --threads: 1000000 threads; at most {4 * cores} (4 per CPU core; "
            f"this machine has {cores})"), err[-2000:]


def test_an_update_or_a_run_without_end_is_refused_by_the_parser(tiny_dir: Path) -> None:
    """--accumulate 1e9 and --epochs 1e9 started a run of one update of 64e9 tokens over 1,902."""
    for flag, value, limit in (("--accumulate", "1000000000", "4,096"), ("--epochs", "1e9", "10,000")):
        code, err = run_cli(["finetune", "x.txt", "--out", "run", flag, value, "--weights", str(tiny_dir)])
        assert code == 2 and err.splitlines()[-1] == (
            f"gpt2 finetune: error: argument {flag}: {value}: at most {limit}"), err[-2000:]


def test_a_seed_past_2_63_is_refused_by_the_parser(tiny_dir: Path) -> None:
    """finetune's and eval's --seed as generate's: [0, 2^63) (finetune's overflowed inside torch, an internal error)."""
    code, err = run_cli(["finetune", "x.txt", "--out", "run", "--seed", str(10**23), "--weights", str(tiny_dir)])
    assert code == 2 and err.splitlines()[-1] == (
        f"gpt2 finetune: error: argument --seed: {10**23}: expected an integer in [0, 2^63)"), err[-2000:]


def test_absurd_sizes_and_a_nan_cache_are_refused(trained_dir: Path, saes_dir: Path, tmp_path: Path) -> None:
    """A count past 2^63 (islice and torch's sizes raised deep inside), a dashboard --top of 1e9 (an 800 GB tensor) and
    --prefix-cache-mb nan (past every comparison) were internal errors."""
    text = tmp_path / "a.txt"
    text.write_text("Return the number of items in the list. " * 50)
    sae = ["--sae", str(saes_dir / "standard-resid"), "--weights", str(trained_dir), "--quiet"]
    for args, line in (
            (["sae", "eval", str(text), *sae, "--max-windows", str(10**20)],
             f"gpt2 sae eval: error: argument --max-windows: {10**20}: at most 2^63 - 1"),
            (["sae", "dashboard", str(text), *sae, "--out", str(tmp_path / "d"), "--top", "1000000000"],
             "gpt2 sae dashboard: error: argument --top: 1000000000: at most 1,000")):
        code, err = run_cli(args)
        assert code == 2 and err.splitlines()[-1] == line, err[-2000:]
    one_line_error(*run_cli(["score", str(text), "--weights", str(trained_dir), "--prefix-cache-mb", "nan"]),
                   r"prefix cache size must be a positive number of MB, got nan$")


# --- the fourth attack: a corrupt resume state, adapters and checkpoints that overflow, convert onto its source ------

RUN = ["--context", "32", "--batch-size", "2", "--steps", "4", "--save-every", "2", "--eval-every", "2",
       "--threads", "2"]


@pytest.fixture(scope="module")
def finished_run(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the text, the folder of a run of 4 updates of the tiny model on it): its last/ is what --resume reads."""
    d = tmp_path_factory.mktemp("run")
    text = d / "ft.txt"
    text.write_text("Return the value of the key in the mapping. " * 300)
    code, err = cli("finetune", str(text), "--weights", str(tiny_dir), "--out", str(d / "out"), *RUN)
    assert code == 0, err[-2000:]
    return text, d / "out"


def edit_state(**fields: object) -> Callable[[Path], None]:
    def edit(last: Path) -> None:
        state = json.loads((last / "trainer_state.json").read_text())
        (last / "trainer_state.json").write_text(json.dumps({**state, **fields}))
    return edit


def edit_moments(edit: Callable[[dict[str, torch.Tensor]], None]) -> Callable[[Path], None]:
    def edit_file(last: Path) -> None:
        from safetensors.torch import load_file, save_file

        moments = load_file(str(last / "optimizer.safetensors"))
        edit(moments)
        save_file(moments, str(last / "optimizer.safetensors"))
    return edit_file


def truncate(name: str, size: Callable[[int], int]) -> Callable[[Path], None]:
    def edit(last: Path) -> None:
        path = last / name
        os.truncate(path, size(path.stat().st_size))
    return edit


GENERATOR = "expected a list of 5,056 bytes (integers in [0, 255]): torch's CPU generator state"
STEP = "expected an integer in [1, 4] (the updates done, of this run's 4)"


@pytest.mark.parametrize("edit, line", [
    (lambda last: (last / "trainer_state.json").write_text("[]"),
     "{state}: expected a JSON object (the training state gpt2 finetune writes), found []"),
    (edit_state(trajectory=None), "{state}: trajectory is null, expected a JSON object (the run's settings, data and "
                                  "base, as gpt2 finetune writes them)"),
    (edit_state(generator=[1, 2, 3]), "{state}: generator is [1, 2, 3], " + GENERATOR),
    (edit_state(generator=[999] * 5056),
     "{state}: generator is [999, 999, 999, 999, 999, 999, 999, 999,... (list of 5,056), " + GENERATOR),
    (edit_state(generator="abc"), '{state}: generator is "abc", ' + GENERATOR),
    (edit_state(step=-5), "{state}: step is -5, " + STEP),
    (edit_state(step="4"), '{state}: step is "4", ' + STEP),
    (edit_state(step=10**12), "{state}: step is 1000000000000, " + STEP),  # was accepted: "trained in 1e12 updates"
    (edit_state(step=4.5), "{state}: step is 4.5, " + STEP),
    (edit_state(best=[float("nan"), 4]), "{state}: best is [NaN, 4], expected null or [validation loss, step]: a "
                                         "finite loss >= 0 and a step in [0, 4]"),
    (truncate("trainer_state.json", lambda size: 5 << 30),  # sparse: read whole, it was a MemoryError at 5 GB
     "{state}: 5.0 GiB; expected a training state of at most 64 MiB"),
    (truncate("optimizer.safetensors", lambda size: 1000),
     "{optimizer}: not a readable safetensors file (Error while deserializing header: invalid header length)"),
    (truncate("optimizer.safetensors", lambda size: size // 2),
     "{optimizer}: not a readable safetensors file (Error while deserializing header: incomplete metadata, file not "
     "fully covered)"),
    (edit_moments(lambda m: m.update({"m.wte.weight": torch.zeros(3)})),
     "{optimizer}: m.wte.weight is float32 of shape [3], expected float32 of shape [50257, 64]"),
    (edit_moments(lambda m: m.update({"v.wpe.weight": m["v.wpe.weight"].half()})),
     "{optimizer}: v.wpe.weight is float16 of shape [128, 64], expected float32 of shape [128, 64]"),
    # a NaN moment resumed, then ended in "the loss became nan ... the last good checkpoint is in OUT/last (try a
    # lower --lr)": neither was true
    (edit_moments(lambda m: m["v.h.1.ln_2.bias"].__setitem__(5, float("nan"))),
     "{optimizer}: v.h.1.ln_2.bias holds 1 NaN/Inf values, expected a finite optimizer state"),
    (edit_moments(lambda m: m["v.h.1.ln_2.bias"].__setitem__(5, -1.0)),
     "{optimizer}: v.h.1.ln_2.bias holds negative values, expected a second moment (a mean of squares) >= 0"),
], ids=["state-a-list", "trajectory-null", "generator-3-bytes", "generator-999s", "generator-a-string", "step-negative",
        "step-a-string", "step-1e12", "step-4.5", "best-nan", "state-5-GiB", "optimizer-1000-bytes", "optimizer-half",
        "optimizer-tensor-shape", "optimizer-float16", "optimizer-nan", "optimizer-negative-v"])
def test_a_corrupt_resume_state_is_one_line_naming_its_field(edit: Callable[[Path], None], line: str,
                                                              finished_run: tuple[Path, Path], tiny_dir: Path,
                                                              tmp_path: Path) -> None:
    """finetune --resume checks last/'s trainer_state.json field by field and the optimizer's moments by name, shape,
    dtype and value before restoring any of them (each case was an internal error, or a resume that went wrong)."""
    text, run = finished_run
    out = tmp_path / "out"
    shutil.copytree(run, out)
    edit(out / "last")
    code, err = cli("finetune", str(text), "--weights", str(tiny_dir), "--out", str(out), *RUN, "--resume")
    expected = line.format(state=out / "last" / "trainer_state.json", optimizer=out / "last" / "optimizer.safetensors")
    assert (code, err.strip().splitlines()) == (2, [f"gpt2 finetune: error: {expected}"]), err[-3000:]


def test_the_finished_run_itself_resumes(finished_run: tuple[Path, Path], tiny_dir: Path, tmp_path: Path) -> None:
    """The checks refuse none of what a run writes: resuming it untouched is a run with nothing left to do."""
    text, run = finished_run
    shutil.copytree(run, tmp_path / "out")
    code, err = cli("finetune", str(text), "--weights", str(tiny_dir), "--out", str(tmp_path / "out"), *RUN, "--resume")
    assert code == 0 and "resuming at update 4" in err, err[-3000:]


def test_convert_refuses_to_write_over_a_file_of_its_source(tiny_dir: Path, tmp_path: Path) -> None:
    """A destination that is an existing file or folder inside the source directory was overwritten (convert tiny
    tiny/config.json --to gguf exited 0 with the source's config a GGUF); a new file beside them is still written."""
    src = tmp_path / "tiny"
    shutil.copytree(tiny_dir, src)
    before = {p.name: p.read_bytes() for p in src.iterdir() if p.is_file()}
    (src / "last").mkdir()
    for dst, to, kind in ((src / "config.json", "gguf", "file"), (src / "model.safetensors", "llmc", "file"),
                          (src / "sub" / ".." / "vocab.json", "gguf", "file"), (src / "last", "hf", "folder")):
        code, err = cli("convert", str(src), str(dst), "--to", to)
        assert (code, err.strip().splitlines()) == (2, [
            f"gpt2 convert: error: {dst}: an existing {kind} of the source checkpoint {src}, which writing would "
            "destroy; write the converted checkpoint somewhere else (or to a new file)"]), err[-3000:]
    assert {p.name: p.read_bytes() for p in src.iterdir() if p.is_file()} == before
    assert cli("convert", str(src), str(src / "model.gguf"), "--to", "gguf")[0] == 0


def hf_variant(tiny_dir: Path, d: Path, edit: Callable[[dict[str, torch.Tensor]], None] | None = None) -> Path:
    """A copy of the tiny checkpoint (safetensors only) with its tensors edited."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(tiny_dir, d, ignore=shutil.ignore_patterns("pytorch_model.bin"))
    if edit is not None:
        tensors = load_file(str(d / "model.safetensors"))
        edit(tensors)
        save_file(tensors, str(d / "model.safetensors"))
    return d


@pytest.mark.parametrize("edit, line", [
    (lambda t: t.update({"ln_f.weight": t["ln_f.weight"].to(torch.float8_e4m3fn)}),  # torch has no isfinite for it
     "{weights}: tensor ln_f.weight has dtype float8_e4m3fn, expected one of float32, float16, bfloat16, float64"),
    (lambda t: t["wte.weight"].fill_(1e38),  # finite, so the NaN check passed, and every logit was NaN
     "{weights}: tensor wte.weight holds values up to 1e+38 in magnitude, expected at most 10000 (trained GPT-2 "
     "weights are of order 1; larger ones overflow float32 activations)"),
    (None, "{vocab}: expected a JSON object of token -> integer id (GPT-2's vocabulary), found list"),
], ids=["float8-ln_f", "wte-1e38", "vocab-a-list"])
def test_a_checkpoint_the_engine_cannot_compute_with_is_one_line(edit: Callable | None, line: str, tiny_dir: Path,
                                                                 tmp_path: Path) -> None:
    """Hugging Face checkpoints that were internal errors: a float8 tensor, weights that overflow, a vocab.json that is
    not a mapping."""
    d = hf_variant(tiny_dir, tmp_path / "model", edit)
    if edit is None:
        (d / "vocab.json").write_text("[1, 2]")
    code, err = cli("generate", "hi", "-n", "3", "--temperature", "0", "--weights", str(d))
    expected = line.format(weights=d / "model.safetensors", vocab=d / "vocab.json")
    assert (code, err.strip().splitlines()) == (2, [f"gpt2 generate: error: {expected}"]), err[-3000:]


@pytest.mark.parametrize("poisoned, value, named", [
    (("token_embd.weight", "output.weight"), float("nan"), "token_embd.weight"),  # both copies, as a tied export has it
    (("token_embd.weight",), float("nan"), "token_embd.weight"),
    (("output.weight",), float("inf"), "output.weight"),
], ids=["nan-in-both", "nan-in-token_embd", "inf-in-output"])
def test_a_nan_in_a_ggufs_tied_embedding_is_named(poisoned: tuple[str, ...], value: float, named: str, tiny_dir: Path,
                                                  tmp_path: Path) -> None:
    """A NaN in token_embd (which output.weight repeats) was refused as 'output.weight differs from
    token_embd.weight': NaN equals nothing, itself included. It is named as the Hugging Face loader names one."""
    gguf = pytest.importorskip("gguf", reason="gguf (llama.cpp's gguf-py) is part of the test extra")
    path = tmp_path / "m.gguf"
    assert cli("convert", str(tiny_dir), str(path), "--to", "gguf", "--type", "f32")[0] == 0
    found = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    with open(path, "r+b") as f:
        for name in poisoned:
            f.seek(found[name].data_offset)
            f.write(struct.pack("<f", value))
    code, err = cli("generate", "hi", "-n", "2", "--temperature", "0", "--weights", str(path))
    assert (code, err.strip()) == (2, f"gpt2 generate: error: {path}: tensor {named} holds 1 NaN/Inf values, "
                                      "expected finite weights")


def lora_dir(tiny_dir: Path, d: Path, edit: Callable[[dict[str, torch.Tensor], dict], None]) -> Path:
    """An adapter of rank 4 (lora_alpha 8) on every projection of the tiny model, B as trained ones are (not zero),
    its tensors (PEFT's names and orientation) and config edited."""
    from safetensors.torch import load_file, save_file

    from gpt2_engine.core.config import GPT2Config
    from gpt2_engine.core.lora import LoraAdapter, LoraSettings, new_adapter
    from gpt2_engine.formats.peft import save_adapter

    config = GPT2Config.from_json(tiny_dir / "config.json")
    fresh = new_adapter(config, LoraSettings(r=4, alpha=8.0), torch.Generator().manual_seed(0))
    tensors = {n: torch.full_like(t, 0.01) if n.endswith("lora_B") else t for n, t in fresh.tensors.items()}
    save_adapter(d, LoraAdapter(fresh.settings, tensors))
    weights, cfg = load_file(str(d / "adapter_model.safetensors")), json.loads((d / "adapter_config.json").read_text())
    edit(weights, cfg)
    save_file(weights, str(d / "adapter_model.safetensors"))
    (d / "adapter_config.json").write_text(json.dumps(cfg))
    return d


PEFT = "base_model.model.transformer."


@pytest.mark.parametrize("edit, line", [
    (lambda t, c: t[PEFT + "h.1.mlp.c_fc.lora_B.weight"].fill_(float("nan")),
     "{weights}: tensor " + PEFT + "h.1.mlp.c_fc.lora_B.weight holds 1024 NaN/Inf values, expected finite weights"),
    (lambda t, c: [x.fill_(1e30) for x in t.values()],  # finite, and every logit NaN
     "{adapter}: its update to h.0.attn.c_attn (lora_A x lora_B x the scale 2, from lora_alpha 8 and r 4) holds "
     "values up to 8e+60, expected at most 10000 like any weight (larger ones overflow float32 activations)"),
    (lambda t, c: c.update(lora_alpha=1e308),
     "{config}: lora_alpha 1e+308 over r 4 scales the update by 2.5e+307, expected at most 10000 (a scale this large "
     "overflows float32 activations)"),
    (lambda t, c: c.update(lora_alpha=float("nan")), "{config}: lora_alpha: expected a finite number > 0, got nan"),
    (lambda t, c: t.update({PEFT + "h.0.attn.c_attn.lora_A.weight": torch.zeros(3, 3)}),  # said "expected [3, 64]"
     "{weights}: " + PEFT + "h.0.attn.c_attn.lora_A.weight has shape [3, 3], expected [4, 64] for this model"),
], ids=["nan-tensor", "tensors-1e30", "alpha-1e308", "alpha-nan", "shape-names-r"])
def test_an_adapter_that_overflows_is_one_line(edit: Callable, line: str, tiny_dir: Path, tmp_path: Path) -> None:
    """generate --lora with adapter weights that made NaN logits (an internal error): checked at load as a
    checkpoint's weights are, finite and each projection's update within the same bound."""
    d = lora_dir(tiny_dir, tmp_path / "adapter", edit)
    code, err = cli("generate", "hi", "-n", "2", "--temperature", "0", "--weights", str(tiny_dir), "--lora", str(d))
    expected = line.format(adapter=d, weights=d / "adapter_model.safetensors", config=d / "adapter_config.json")
    assert (code, err.strip().splitlines()) == (2, [f"gpt2 generate: error: {expected}"]), err[-3000:]


def drop(t: dict[str, torch.Tensor], *parts: str) -> None:
    """The adapter tensors whose names hold any of `parts` left out of the file."""
    for key in [k for k in t if any(p in k for p in parts)]:
        del t[key]


@pytest.mark.parametrize("edit, line", [
    (lambda t, c: c.update(layers_to_transform=[0]),  # PEFT loads layer 0's tensors only; both were applied
     "{config}: layers_to_transform [0] leaves out layer 1, whose h.1.attn.c_attn the adapter's weights update (PEFT "
     "would not load that update)"),
    (lambda t, c: c.update(target_modules=["q_proj"]),  # another model's name; PEFT raises
     "{config}: target_modules entry 'q_proj' names none of GPT-2's projections (c_attn, attn.c_proj, c_fc, "
     "mlp.c_proj; c_proj for both)"),
    (lambda t, c: c.update(target_modules=["c_attn"]),
     "{config}: target_modules ['c_attn'] does not select h.0.attn.c_proj, which the adapter's weights update (PEFT "
     "would not load that update)"),
    (lambda t, c: c.pop("target_modules"),
     "{config}: target_modules ['c_attn'] (PEFT's default for GPT-2, as the config gives none) does not select "
     "h.0.attn.c_proj, which the adapter's weights update (PEFT would not load that update)"),
    (lambda t, c: c.update(target_modules=r".*\.(c_attn|c_proj|c_fc)"),
     None),  # one regular expression, which PEFT matches against whole names: read, not checked (see target_list)
    (lambda t, c: c.update(target_modules=[3]),
     "{config}: target_modules is [3], expected a list of module names (or one regular expression)"),
    (lambda t, c: c.update(layers_to_transform="0"),
     "{config}: layers_to_transform is \"0\", expected a layer index or a list of them"),
    (lambda t, c: c.update(layers_to_transform=[0], layers_pattern="layers"),
     "{config}: layers_pattern 'layers' is not GPT-2's (its layers are transformer.h.N)"),
    (lambda t, c: c.update(lora_alpha="8"), "{config}: lora_alpha is \"8\", expected a number"),  # was read as 8
    (lambda t, c: c.update(lora_alpha=True), "{config}: lora_alpha is true, expected a number"),
    (lambda t, c: c.update(lora_dropout="0.1"), "{config}: lora_dropout is \"0.1\", expected a number"),
    (lambda t, c: c.update(use_rslora="false"),  # bool("false"): the scale alpha / sqrt(r), silently
     "{config}: use_rslora is \"false\", expected true or false"),
    # the thirteenth attack's: fields that were ignored, and a flag as a string
    (lambda t, c: c.update(exclude_modules=["c_fc"]),  # PEFT leaves c_fc out; its update was applied
     "{config}: exclude_modules entry 'c_fc' leaves out h.0.mlp.c_fc, which the adapter's weights update (PEFT would "
     "not load that update)"),
    (lambda t, c: c.update(exclude_modules=".*c_fc"),
     "{config}: exclude_modules is \".*c_fc\", expected a list of module names (a regular expression is not "
     "supported)"),
    (lambda t, c: c.update(exclude_modules=["lm_head"]), None),  # excludes what the adapter does not update
    (lambda t, c: c.update(layers_to_transform=[]),  # every layer was adapted; PEFT finds no module and raises
     "{config}: layers_to_transform is [], which selects no layer (PEFT finds nothing to adapt); leave it out for "
     "every layer"),
    (lambda t, c: c.update(layer_replication=[[0, 2], [0, 2]]),  # PEFT stacks layers; it was ignored
     "{config}: layer_replication=[[0, 2], [0, 2]] is not supported (plain LoRA on the projections only)"),
    (lambda t, c: c.update(fan_in_fan_out="true"), "{config}: fan_in_fan_out is \"true\", expected true or false"),
], ids=["layers-0", "q_proj", "targets-fewer", "targets-absent", "targets-regex", "targets-int", "layers-str",
        "layers-pattern", "alpha-str", "alpha-bool", "dropout-str", "rslora-str", "exclude-c_fc", "exclude-regex",
        "exclude-unused", "layers-empty", "layer-replication", "fan-in-fan-out-str"])
def test_an_adapter_config_says_what_peft_would_apply(edit: Callable, line: str | None, tiny_dir: Path,
                                                      tmp_path: Path) -> None:
    """adapter_config.json fields that were not read: layers_to_transform and target_modules (the file's tensors
    were applied whatever they said), and lora_alpha as a string. A config PEFT would read otherwise is one line."""
    d = lora_dir(tiny_dir, tmp_path / "adapter", edit)
    code, err = cli("generate", "hi", "-n", "2", "--temperature", "0", "--weights", str(tiny_dir), "--lora", str(d))
    if line is None:
        assert code == 0, err[-3000:]
        return
    expected = line.format(config=d / "adapter_config.json")
    assert (code, err.strip().splitlines()) == (2, [f"gpt2 generate: error: {expected}"]), err[-3000:]


def test_an_adapter_within_its_layers_and_targets_loads(tiny_dir: Path, tmp_path: Path) -> None:
    """The selection PEFT makes, kept: layer 0's tensors under layers_to_transform 0 (an index, or a list), and the
    projections target_modules names as PEFT matches them (c_proj is both, attn.c_proj the attention's only)."""
    from gpt2_engine.core.config import GPT2Config
    from gpt2_engine.formats.peft import load_adapter

    config = GPT2Config.from_json(tiny_dir / "config.json")
    cases = [(lambda t, c: (c.update(layers_to_transform=0, layers_pattern="h"), drop(t, ".h.1.")), 4),
             (lambda t, c: (c.update(layers_to_transform=[1]), drop(t, ".h.0.")), 4),
             (lambda t, c: (c.update(target_modules=["c_attn", "c_proj"]), drop(t, "c_fc")), 6),
             (lambda t, c: (c.update(target_modules=["transformer.h.0.attn.c_proj", "mlp.c_proj"]),
                            drop(t, "c_attn", "c_fc", ".h.1.attn")), 3)]
    for n, (edit, modules) in enumerate(cases):
        adapter = load_adapter(lora_dir(tiny_dir, tmp_path / str(n), edit), config)
        assert len(adapter.tensors) == 2 * modules


def test_score_refuses_to_write_over_a_document_it_scores(tiny_dir: Path, tmp_path: Path) -> None:
    """`score doc.txt --per-token doc.txt` replaced the corpus with its own figures (exit 0), through a link too."""
    doc = tmp_path / "doc.txt"
    doc.write_text("The quick brown fox.\n")
    (tmp_path / "link.txt").symlink_to(doc)
    for flag, dest in (("--per-token", doc), ("--output", tmp_path / "link.txt")):
        code, err = cli("score", str(doc), flag, str(dest), "--weights", str(tiny_dir))
        assert (code, err) == (2, f"gpt2 score: error: {flag} {dest}: is {doc}, one of the inputs, which writing "
                                  "would replace; write the results somewhere else\n")
    assert doc.read_text() == "The quick brown fox.\n"
    code, err = cli("score", str(doc), "--per-token", str(tmp_path / "f.json"), "--output", str(tmp_path / "f.json"),
                    "--weights", str(tiny_dir))
    assert (code, err) == (2, f"gpt2 score: error: --per-token and --output are the same file ({tmp_path / 'f.json'}): "
                              "give each its own\n")
    shutil.copytree(tiny_dir, tmp_path / "w")  # the checkpoint's own files: it became unloadable
    for flag, name in (("--per-token", "config.json"), ("--output", "model.safetensors")):
        dest = tmp_path / "w" / name
        code, err = cli("score", str(doc), flag, str(dest), "--weights", str(tmp_path / "w"))
        assert (code, err) == (2, f"gpt2 score: error: {flag} {dest}: is {dest}, one of the inputs (a file of the "
                                  "--weights checkpoint), which writing would replace; write the results somewhere "
                                  "else\n")
    assert (tmp_path / "w" / "config.json").read_bytes() == (tiny_dir / "config.json").read_bytes()


def test_sigterm_during_convert_removes_the_partial_file(small_dir: Path, tmp_path: Path) -> None:
    """SIGTERM (a job runner's stop, `timeout`) left 400-650 MB `.part` files beside the destination, which no rerun
    cleared; it now ends the command as Ctrl-C does: the partial file removed, exit 143."""
    import signal
    import time

    dest = tmp_path / "m.gguf"
    proc = subprocess.Popen([sys.executable, "-m", "gpt2_engine", "convert", str(small_dir), str(dest), "--to", "gguf"],
                            stderr=subprocess.PIPE, text=True, cwd=ROOT)
    deadline = time.monotonic() + TIMEOUT
    while not list(tmp_path.glob(".m.gguf.*.part")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)  # until the writer has started its file (bounded by the deadline)
    assert proc.poll() is None, "the conversion ended before it could be stopped"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=TIMEOUT)
    assert (proc.returncode, err) == (143, "gpt2 convert: terminated\n")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("how", ["atomic_write", "score"])
def test_a_stop_just_after_the_temporary_file_is_made_still_removes_it(how: str, small_dir: Path, tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """CI once caught the SIGTERM above landing between mkstemp and the try that removes the file, which stayed
    behind; the two are now one step for a stop. The stop is sent from inside the creation itself."""
    import signal

    from gpt2_engine import cli
    from gpt2_engine.formats import files

    made = files.temporary

    def temporary_then_stopped(dest: Path) -> tuple[int, Path]:
        fd, tmp = made(dest)
        os.kill(os.getpid(), signal.SIGTERM)
        return fd, tmp

    monkeypatch.setattr(files, "temporary", temporary_then_stopped)
    out = tmp_path / "out"
    out.mkdir()
    if how == "atomic_write":
        previous = signal.signal(signal.SIGTERM, cli.terminate)
        try:
            with pytest.raises(cli.Terminated):
                files.atomic_write(out / "m.bin", lambda p: p.write_bytes(b"x"))
        finally:
            signal.signal(signal.SIGTERM, previous)
    else:
        (doc := tmp_path / "doc.txt").write_text("Hello there.")
        assert cli.main(["score", str(doc), "--weights", str(small_dir), "--output", str(out / "s.jsonl"),
                         "--per-token", str(out / "t.jsonl")]) == 143
    assert os.listdir(out) == []


def fifo_at(path: Path) -> Path:
    path.unlink(missing_ok=True)
    os.mkfifo(path)
    return path


@pytest.mark.parametrize("make, pattern", [
    (lambda tiny, tmp: ["sae", "features", "hi", "--weights", str(tiny), "--hook", "blocks.0.hook_resid_pre",
                        "--sae", str(fifo_at(tmp / "openai.pt"))],
     r"openai.pt: not a state dict torch can read safely \(a FIFO there, not a regular file\)$"),
    (lambda tiny, tmp: ["sae", "features", "hi", "--weights", str(tiny),
                        "--sae", str(fifo_at(saelens_dir(tmp) / "sae_weights.safetensors").parent)],
     r"sae: sae_weights.safetensors is a FIFO, not a regular file \(expected SAELens's directory"),
    (lambda tiny, tmp: ["generate", "Hi", "-n", "2", "--weights", str(tiny), "--steer",
                        f"vector={fifo_at(tmp / 'v.pt')},hook=blocks.0.hook_resid_pre,coef=1"],
     r"v.pt: a FIFO, not a regular file$"),
    (lambda tiny, tmp: ["generate", "Hi", "-n", "2", "--weights",
                        str(fifo_at(Path(shutil.copytree(tiny, tmp / "ckpt")) / "model.safetensors").parent)],
     r"ckpt/model.safetensors: a FIFO, not a regular file$"),
], ids=["openai-sae", "saelens-weights", "steering-vector", "model.safetensors"])
def test_a_fifo_as_a_model_sae_or_vector_file_is_named_as_what_it_is(make: Callable, pattern: str, tiny_dir: Path,
                                                                     tmp_path: Path) -> None:
    """A FIFO as OpenAI's SAE .pt waited for a writer forever; as other files it was reported missing ("no such
    file", "no model.safetensors found"): each is refused before it is opened, naming what is there."""
    one_line_error(*run_cli(make(tiny_dir, tmp_path)), pattern)


@pytest.mark.parametrize("name, make, kind", [
    ("adapter_model.safetensors", fifo_at, "a FIFO"),
    ("adapter_model.safetensors", lambda p: (p.unlink(), p.mkdir()), "a directory"),
    ("adapter_base.json", fifo_at, "a FIFO"),
], ids=["weights-fifo", "weights-folder", "base-record-fifo"])
def test_an_adapters_file_that_is_not_regular_is_named_as_what_it_is(name: str, make: Callable, kind: str,
                                                                     tiny_dir: Path, tmp_path: Path) -> None:
    """A FIFO or folder as adapter_model.safetensors was reported as 'no adapter_model.safetensors', and a FIFO
    adapter_base.json was taken as absent, so the check of the adapter's base was skipped without a word."""
    d = lora_dir(tiny_dir, tmp_path / "adapter", lambda weights, cfg: None)
    (d / name).touch()
    make(d / name)
    code, err = run_cli(["generate", "hi", "-n", "2", "--weights", str(tiny_dir), "--lora", str(d)])
    assert (code, err.strip().splitlines()) == (2, [f"gpt2 generate: error: {d / name}: {kind}, not a regular file"])


def test_an_adapters_base_record_linked_to_nothing_is_named(tiny_dir: Path, tmp_path: Path) -> None:
    """A dangling adapter_base.json was taken as absent, and the check of the adapter's base skipped."""
    d = lora_dir(tiny_dir, tmp_path / "adapter", lambda weights, cfg: None)
    (d / "adapter_base.json").unlink(missing_ok=True)
    (d / "adapter_base.json").symlink_to(tmp_path / "gone.json")
    code, err = run_cli(["generate", "hi", "-n", "2", "--weights", str(tiny_dir), "--lora", str(d)])
    assert (code, err.strip().splitlines()) == (2, [f"gpt2 generate: error: {d / 'adapter_base.json'}: a link to "
                                                    f"{tmp_path / 'gone.json'}, which does not exist"])


@pytest.mark.parametrize("name", ["config.json", "vocab.json"])
def test_convert_to_hf_never_writes_into_a_fifo_in_out(name: str, tiny_dir: Path, tmp_path: Path) -> None:
    """A checkpoint's files are replaced together: a FIFO among them in OUT (--overwrite) blocked the writer after
    model.safetensors had been replaced; it is refused before anything is written."""
    shutil.copytree(tiny_dir, tmp_path / "out")
    before = (tmp_path / "out" / "model.safetensors").read_bytes()
    fifo_at(tmp_path / "out" / name)
    code, err = run_cli(["convert", str(tiny_dir), str(tmp_path / "out"), "--to", "hf", "--overwrite"])
    assert (code, err.strip().splitlines()) == (2, [
        f"gpt2 convert: error: {tmp_path / 'out' / name}: a FIFO, not a regular file; a checkpoint's files are "
        "replaced, never written into"])
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == before


def test_a_fifo_as_a_metadata_file_is_refused_without_waiting(tiny_dir: Path, tmp_path: Path) -> None:
    """A FIFO as config.json or adapter_config.json waited in open() for a writer, forever."""
    shutil.copytree(tiny_dir, tmp_path / "ckpt")
    (tmp_path / "ckpt" / "config.json").unlink()
    os.mkfifo(tmp_path / "ckpt" / "config.json")
    one_line_error(*run_cli(["generate", "hi", "-n", "2", "--weights", str(tmp_path / "ckpt")]),
                   rf"{re.escape(str(tmp_path / 'ckpt' / 'config.json'))}: not a regular file \(a FIFO, a device or a "
                   r"folder\); expected a JSON config$")
