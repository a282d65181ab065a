"""The matrices a decode step streams, and its KV cache, on 2 MB pages.

Why: a decode step reads every weight once, a few hundred MB, and on 4 KB pages each 64 lines of it need a
translation of their own, whose page walks sit in the memory stream: on an AVX2 EPYC, a bfloat16, int8 or int4
decode step runs faster with its matrices on 2 MB pages (docs/benchmarks.md). Linux backs an anonymous mapping with
transparent huge pages where it is advised to (MADV_HUGEPAGE; THP in "madvise" or "always" mode), never torch's own
allocations in "madvise" mode. So a loaded model's converted or quantized block matrices and head are moved into
one such mapping (one for all of them: each rounded to 2 MB on its own would waste up to 4 MB a matrix). Each copy
starts at its source's offset within a 64-byte line, so the kernels take the same paths (decode.cpp aligns some
tiles to the line) and give the same bits; only the page size changes. Panels (weights.PanelMatrix) are written
into such a mapping of their own as the loader makes them (HugeArena), which saves moving them after. The KV cache
is made on such pages too (huge_zeros): a decode step's attention reads each (row, head)'s keys and values as two
short streams, and on 4 KB pages their page walks showed in its time (docs/benchmarks.md).
"""

from __future__ import annotations

import ctypes
import math
import mmap
import sys
from collections.abc import Mapping
from pathlib import Path

import torch

from .weights import FilePages, GPT2Weights, PanelMatrix, QuantizedMatrix, file_pages, libc, release_heap

HUGE_PAGE = 2 << 20  # bytes: x86-64's transparent huge page
LINE = 64  # bytes
COPY_CHUNK = 8 << 20  # bytes of a file-backed tensor copied between releases of its pages
MADV_HUGEPAGE = 14  # Linux
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_pages_available(mode_file: Path = THP_MODE) -> bool:
    """Whether advised anonymous memory can get transparent huge pages here (Linux, mode "always" or "madvise")."""
    if sys.platform != "linux":
        return False
    try:
        mode = mode_file.read_text()
    except OSError:
        return False
    return "[always]" in mode or "[madvise]" in mode


def huge_region(nbytes: int) -> torch.Tensor:
    """[nbytes] uint8 of a new anonymous mapping advised as huge pages, starting on a 2 MB boundary (a huge page
    must); the tensor and its views hold the mapping alive. Untouched: the advice is given before the first touch,
    so that the page faults allocate huge pages (if it fails, 4 KB pages: the same values, at the old speed)."""
    size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    region = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(region, dtype=torch.uint8)  # [size + 2 MB] bytes, holding `region` alive
    base = -raw.data_ptr() % HUGE_PAGE  # the first 2 MB boundary
    libc().madvise(ctypes.c_void_p(raw.data_ptr() + base), ctypes.c_size_t(size), MADV_HUGEPAGE)
    return raw[base : base + nbytes]


def huge_zeros(shape: tuple[int, ...], dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu") -> torch.Tensor:
    """A zero-filled tensor of `shape`: on the CPU, on 2 MB pages where the system gives them and it fills at least
    one (a new anonymous mapping reads as zeros until written); else torch.zeros. What KVCache.allocate makes a cache
    of."""
    nbytes = math.prod(shape) * dtype.itemsize
    if torch.device(device).type != "cpu" or nbytes < HUGE_PAGE or not huge_pages_available():
        return torch.zeros(shape, dtype=dtype, device=device)
    return huge_region(nbytes).view(dtype).view(shape)


class HugeArena:
    """Room on huge pages for tensors the loader makes (PanelMatrix's panels): each is written once, in place, where
    making it elsewhere and then moving it (move_to_huge_pages) wrote it twice. Pieces start on 64-byte lines, as
    torch's own allocations do, so the kernels take the same paths."""

    def __init__(self, nbytes: int) -> None:
        self.raw = huge_region(nbytes)
        self.used = 0

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised tensor of `shape` and `dtype` in the arena (a MemoryError past its size)."""
        nbytes = math.prod(shape) * dtype.itemsize
        if self.used + nbytes > self.raw.numel():
            raise MemoryError(f"HugeArena: {nbytes} bytes asked with {self.raw.numel() - self.used} left")
        piece = self.raw[self.used : self.used + nbytes].view(dtype).view(shape)
        self.used += nbytes + -nbytes % LINE
        return piece

    def holds(self, t: torch.Tensor) -> bool:
        return t.untyped_storage().data_ptr() == self.raw.untyped_storage().data_ptr()


def move_to_huge_pages(tensors: list[torch.Tensor], in_file: Mapping[int, FilePages] | None = None) -> None:
    """Move contiguous CPU `tensors` into one anonymous mapping advised as huge pages, each at its old offset within
    a 64-byte line. Each tensor's storage is swapped for its copy (Tensor.set_) as soon as the copy is made, so every
    holder of these tensor objects reads the copy, and the old memory goes tensor by tensor (where nothing else
    holds it): a load's peak grows by one tensor, not by all of them. The mapping lives as long as any of them.
    in_file: the pages of those `tensors` read in place from the checkpoint file, by id(tensor) (the file's mapping
    outlives them, held by its other tensors): released as they are copied, COPY_CHUNK bytes at a time, so that such
    a tensor adds one chunk to the peak, not its size."""
    starts, end = [], 0
    for t in tensors:
        end += (t.data_ptr() - end) % LINE  # the old offset within a line
        starts.append(end)
        end += t.numel() * t.element_size()
        end += -end % LINE
    raw = huge_region(end)
    for t, at in zip(tensors, starts):
        nbytes = t.numel() * t.element_size()
        copy = raw[at : at + nbytes].view(t.dtype).view(t.shape)
        pages = None if in_file is None else in_file.get(id(t))
        with torch.no_grad():
            if pages is None:
                copy.copy_(t)
            else:
                src, dst, step = t.view(-1), copy.view(-1), COPY_CHUNK // t.element_size()
                for i in range(0, src.numel(), step):
                    dst[i : i + step].copy_(src[i : i + step])
                    pages.release(src[i : i + step])
            t.set_(copy)
        release_heap()  # the old memory, where it was on the C heap (malloc keeps freed heap pages otherwise)


def matrices_on_huge_pages(w: GPT2Weights, file: Path | None = None, arena: HugeArena | None = None) -> None:
    """Move the block matrices and the head of `w` (bfloat16, float32 or packed, with their scales, or panels) onto
    huge pages (move_to_huge_pages), where the system has them; the values, and so every result, stay the same.
    Those the loader wrote into `arena` are there already.

    file: the checkpoint that float32 weights are read in place from (GPT2.from_pretrained passes it only where the
    projections are in panels). Then only the panels and the head move: the plain matrices kept beside the panels
    stay in the file for GEMMs, at no memory of the process's own, and the head's pages there are released as it
    moves. The head reads 1.1x faster off huge pages than through the file's 4 KB mappings (whole decode
    1.016x, docs/benchmarks.md)."""
    if not huge_pages_available():
        return
    matrices = [getattr(b, name).weight for b in w.blocks for name in ("c_attn", "attn_c_proj", "c_fc", "mlp_c_proj")]
    tensors = [t for m in matrices for t in ((m.packed, m.scales) if isinstance(m, QuantizedMatrix)
                                             else (m.panels,) if isinstance(m, PanelMatrix)
                                             else () if file is not None else (m,))]
    # GPT-2's head is wte itself (tied), or its quantized transpose
    tensors += [w.head.packed, w.head.scales] if isinstance(w.head, QuantizedMatrix) else [w.head]
    tensors = [t for t in tensors if arena is None or not arena.holds(t)]  # placed there by the loader already
    if not all(t.device.type == "cpu" and t.is_contiguous() for t in tensors):
        return
    if not tensors:
        return
    pages = None if file is None else file_pages(w.head, file)
    move_to_huge_pages(list({id(t): t for t in tensors}.values()), None if pages is None else {id(w.head): pages})
