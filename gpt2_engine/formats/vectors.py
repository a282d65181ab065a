"""Steering vectors' files: one vector from a .pt / .pth (a tensor, or a dict holding one; read with weights_only,
so no code runs), .safetensors (one tensor) or .npy file (allow_pickle off)."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..core.errors import SteeringError, one_line
from .files import what_is
from .pickles import load_pickle

VECTOR_SUFFIXES = (".pt", ".pth", ".safetensors", ".npy")


def read_vector(path: str | Path) -> torch.Tensor:
    """One vector from a .pt / .pth (a tensor, or a dict holding one; weights_only, so no code runs), .safetensors
    (one tensor) or .npy file (allow_pickle off)."""
    p = Path(path)
    if p.suffix not in VECTOR_SUFFIXES:
        raise SteeringError(f"steering vector {path}: expected a {', '.join(VECTOR_SUFFIXES)} file")
    if not p.is_file():
        kind = what_is(p) if p.exists() else None  # a FIFO is there, not missing
        raise SteeringError(f"steering vector {path}: {f'{kind}, not a regular file' if kind else 'no such file'}")
    try:
        if p.suffix == ".npy":
            with warnings.catch_warnings():  # a shape whose size overflows warns before it fails: the failure says it
                warnings.simplefilter("ignore", RuntimeWarning)
                found: Any = np.array(np.load(p, mmap_mode="r", allow_pickle=False))  # mapped: a shape past the file is refused
        elif p.suffix == ".safetensors":
            from safetensors.torch import load_file

            found = load_file(p)
        else:
            with warnings.catch_warnings():  # torch warns about quantized tensors' deprecation: the dtype check says it
                warnings.simplefilter("ignore")
                found = load_pickle(p)  # weights only: nothing in it runs
    except ValueError as e:  # load_pickle's one line
        raise SteeringError(f"steering vector {path}: not a readable {p.suffix} file ({e})") from None
    except Exception as e:  # noqa: BLE001 - any unreadable .npy or .safetensors file is one line naming it
        raise SteeringError(f"steering vector {path}: not a readable {p.suffix} file ({type(e).__name__}: "
                            f"{one_line(e, 160)})") from None
    if isinstance(found, Mapping):
        tensors = {k: v for k, v in found.items() if isinstance(v, torch.Tensor)}
        if len(tensors) != 1:
            raise SteeringError(f"steering vector {path}: expected one tensor, found {len(tensors)} "
                                f"({', '.join(list(tensors)[:5]) or 'none'})")
        found = next(iter(tensors.values()))
    return as_vector(found, f"steering vector {path}")


def as_vector(v: Any, what: str) -> torch.Tensor:
    """A float32 tensor from a tensor, an array or a list; one-line errors for anything else."""
    t = as_tensor(v, what)
    if not t.is_floating_point() and t.dtype not in (torch.int32, torch.int64):
        raise SteeringError(f"{what}: expected floating-point values, got {t.dtype}")
    if t.dtype == torch.float64 and t.numel() and bool(torch.isfinite(t).all()):
        top = t.abs().max().item()
        if top > torch.finfo(torch.float32).max:
            raise SteeringError(f"{what}: values up to {top:.3g} do not fit float32 (at most 3.4e38)")
    t = t.float().contiguous()
    if t.numel() == 0 or not bool(torch.isfinite(t).all()):
        raise SteeringError(f"{what}: expected finite values, got {'nothing' if t.numel() == 0 else 'inf or nan'}")
    return t


def as_tensor(v: Any, what: str) -> torch.Tensor:
    """A dense CPU tensor of `v`'s values (float64 kept as float64, so that a value past float32 can be named)."""
    if isinstance(v, torch.Tensor):
        if v.is_nested or v.layout != torch.strided or v.device.type != "cpu":  # sparse, nested, or meta (no values)
            kind = "nested" if v.is_nested else v.device.type if v.device.type != "cpu" else \
                str(v.layout).removeprefix("torch.")
            raise SteeringError(f"{what}: expected a dense tensor of values, got a {kind} one")
        return v.detach()
    if not isinstance(v, (np.ndarray, list, tuple)):
        raise SteeringError(f"{what}: expected a tensor, an array or a list of numbers, got {type(v).__name__}")
    try:
        a = np.asarray(v)
    except (TypeError, ValueError):
        raise SteeringError(f"{what}: expected numbers, got {type(v).__name__} that is not numeric") from None
    if a.dtype.kind not in "biuf":  # complex would lose its imaginary part in the cast to float32, silently
        raise SteeringError(f"{what}: expected real numbers, got {type(v).__name__} of {a.dtype}")
    return torch.as_tensor(a.astype(np.float64 if a.dtype == np.float64 else np.float32))
