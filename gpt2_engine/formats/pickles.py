"""Pickled checkpoints (nanoGPT's ckpt.pt, Hugging Face's pytorch_model.bin, OpenAI's SAE state dicts), read by
torch.load with weights_only=True: tensors, containers, numbers and strings only, so nothing in the file runs. A
pickle that asks for anything else (a class to build, a function to call) is refused in one line naming what it asked
for; the engine never retries with weights_only=False, which would run it (torch's own message suggests that)."""

from __future__ import annotations

import pickle
import re
import tarfile
import warnings
import zipfile
from pathlib import Path
from typing import Any

import torch

from ..core.errors import one_line
from .files import what_is


def refusal(e: BaseException) -> str:
    """What torch's weights-only unpickler refused, from its long message: 'it asks for GLOBAL os.system, ...'."""
    text = " ".join(str(e).split())
    asked = re.search(r"GLOBAL ([\w.]+)", text)
    if asked:
        return f"its pickle asks for {asked.group(1)}, code that loading weights only never runs"
    opcode = re.search(r"Unsupported operand (\d+)", text)
    if opcode:  # a pickle of a newer protocol than torch.save's 2, or bytes that are no pickle at all
        return (f"its pickle holds opcode {int(opcode.group(1)):#04x}, which loading weights only does not read "
                f"(torch.save writes pickle protocol 2)")
    detail = re.search(r"WeightsUnpickler error: (.*?)(\. |$)", text)
    if detail:
        return f"its pickle holds more than tensors and plain values ({detail.group(1)[:160]})"
    return f"not a readable pickle ({type(e).__name__}: {text[:160]})"


def check_stored(path: Path) -> None:
    """torch.save stores its zip archive's entries uncompressed (they can be memory-mapped); a compressed entry, which
    torch.load would inflate, can hold a thousand times its size (a 16 KB file, 16 MB of tensor): refused."""
    if not zipfile.is_zipfile(path):
        return  # a legacy pickle, whose storages are read from the file as they are
    with zipfile.ZipFile(path) as archive:
        for entry in archive.infolist():
            if entry.compress_type != zipfile.ZIP_STORED:
                raise ValueError(f"its zip entry {entry.filename} is compressed ({entry.compress_size:,} bytes for "
                                 f"{entry.file_size:,}); torch.save stores its entries as they are")


def check_tensors(found: Any) -> None:
    """Refuse a tensor that is not dense values on the CPU, which every reader here would fail on in its own way: a
    meta tensor (a shape with no values), a sparse or nested one; and one with more values than its storage holds (an
    expanded view, stride 0, pickles as its one stored value and its shape, and the first copy of it allocates every
    value: 1.6 KB on disk, gigabytes in memory)."""
    stack = [("", found)]
    while stack:
        key, v = stack.pop()
        if isinstance(v, dict):
            stack.extend((f"{key}.{k}" if key else str(k), x) for k, x in v.items())
        elif isinstance(v, (list, tuple)):
            stack.extend((f"{key}[{i}]", x) for i, x in enumerate(v))
        elif isinstance(v, torch.Tensor):
            check_tensor(f"its tensor{' ' + key if key else ''}", v)


def check_tensor(what: str, v: torch.Tensor) -> None:
    """ValueError where `v` is not a dense tensor whose storage holds its values (check_tensors)."""
    kind = ("a meta" if v.device.type == "meta" else "a nested" if v.is_nested else
            f"a {str(v.layout).removeprefix('torch.')}" if v.layout != torch.strided else "")
    if kind:
        raise ValueError(f"{what} is {kind} tensor; expected a dense one")
    stored = v.untyped_storage().nbytes() // max(v.element_size(), 1)
    if v.numel() > stored:
        raise ValueError(f"{what} of shape {list(v.shape)} has {v.numel():,} values over {stored:,} stored (an "
                         "expanded view); a weights file stores each value")


def load_pickle(path: Path, mmap: bool = False) -> Any:
    """torch.load(path, weights_only=True) on the CPU, memory-mapped where asked and the file's format allows (files
    written before torch's zip format cannot be); ValueError in one line for a file it will not or cannot read."""
    try:
        kind = what_is(path)
    except OSError as e:  # a symlink loop, a folder it may not enter
        raise ValueError(f"not readable ({e.strerror})") from None
    if kind != "a regular file":  # opening a FIFO waits for a writer, forever
        raise ValueError(f"{kind or 'nothing'} there, not a regular file")
    try:
        check_stored(path)
    except (zipfile.BadZipFile, OSError) as e:
        raise ValueError(f"not a readable zip archive ({e})") from None
    try:
        with open(path, "rb") as f:
            if f.read(2) == b"\x1f\x8b":
                raise ValueError("a gzip-compressed file; torch.load reads torch.save's files as they are (gunzip it)")
        if tarfile.is_tarfile(path):  # torch's own message here asks to retry with weights_only=False, which runs it
            raise ValueError("torch's legacy tar format, which loading weights only does not read (re-save it with "
                             "a current torch.save from a source you trust)")
    except OSError as e:
        raise ValueError(f"not readable ({e.strerror})") from None
    try:
        with warnings.catch_warnings():  # torch warns of a pickle protocol other than its own, then refuses it
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            found = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        raise ValueError(refusal(e)) from None
    except RuntimeError as e:
        if mmap and "mmap" in str(e):
            return load_pickle(path)
        raise ValueError(f"not a readable PyTorch file (RuntimeError: {one_line(e)})") from None
    except Exception as e:  # noqa: BLE001 - a truncated or corrupt file raises whatever its first bad byte causes
        raise ValueError(f"not a readable PyTorch file ({type(e).__name__}: {one_line(e)})") from None
    check_tensors(found)
    return found
