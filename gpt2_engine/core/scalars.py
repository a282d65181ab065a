"""Numbers given to the Python API, read as Python numbers: numpy's and torch's scalars are accepted wherever a Python
number is (np.int64(3) and torch.tensor(3) are the integer 3, np.float32(0.5) is 0.5), and a bool is never a number
(True would otherwise pass for 1, as it is an int in Python)."""

from __future__ import annotations

import numbers
import operator

import numpy as np
import torch


def as_int(value: object) -> int | None:
    """`value` as a Python int: an int, a numpy integer or a 0-d integer tensor (what operator.index takes, a 0-d
    integer array included); None for anything else, bools and floats with integral values included."""
    if isinstance(value, (bool, np.bool_)) or (isinstance(value, torch.Tensor) and (
            value.dim() != 0 or value.dtype == torch.bool)):
        return None
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None


def as_real(value: object) -> float | None:
    """`value` as a Python float: a real number (numbers.Real: Python's and numpy's, integers included) or a 0-d real
    tensor; None for anything else, bools included."""
    if isinstance(value, torch.Tensor):
        if value.dim() != 0 or value.dtype == torch.bool or value.is_complex() or value.is_meta:
            return None
        return float(value.item())
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        return None
    return float(value)


def described(value: object) -> str:
    """`value` for an error message that refuses its type: the type's name, then (briefly) the value."""
    return f"{type(value).__name__} {value!r:.60}"
