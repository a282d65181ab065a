"""What the native kernels are built from and how, in one place: setup.py builds them at install from this (loading
this file by its path, without torch or the package), and kernels/__init__.py builds the same at first use where the
installed module is missing. Adding a kernel file is one line in SOURCES. Standard library only.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

# the package's extension module that setup.py builds (kernels/_native.*.so)
MODULE = "gpt2_engine.core.kernels._native"
# module.cpp binds the entry points of the others; the order is the build's and the digest's
SOURCES = ("decode.cpp", "packed.cpp", "quant.cpp", "attention.cpp", "block.cpp", "training.cpp", "lora.cpp",
           "module.cpp")
# -fno-math-errno: sqrt never sets errno here, and without the flag the compiler keeps training.cpp's loop scalar.
# -fopenmp: without it at::parallel_for compiles to a plain serial call (ATen/Parallel-inl.h), and every kernel ran on
# one thread. With it, the kernels' OpenMP calls bind to the libgomp.so.1 torch has already loaded (same soname; the
# module is only ever imported after torch), so they share torch's thread pool rather than start a second one.
CFLAGS = ("-O3", "-fopenmp", "-fno-math-errno")
LDFLAGS = ("-fopenmp",)


def build_id(directory: Path, torch_version: str) -> str:
    """The sha1 of the sources in `directory` (in SOURCES order) and of the torch they are compiled against: what a
    module built at install records (module.cpp's `build`), so that one built from other sources than those beside
    it (edited since the install), or for another torch, is never loaded."""
    h = hashlib.sha1(torch_version.encode() + b"\0")
    for name in SOURCES:
        h.update(name.encode() + b"\0" + (directory / name).read_bytes() + b"\0")
    return h.hexdigest()
