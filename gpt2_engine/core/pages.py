"""The matrices a decode step streams, on 2 MB pages.

Why: a decode step reads every weight once, a few hundred MB, and on 4 KB pages each 64 lines of it need a
translation of their own, whose page walks sit in the memory stream: on an AVX2 EPYC, a bfloat16, int8 or int4
decode step runs faster with its matrices on 2 MB pages (docs/benchmarks.md). Linux backs an anonymous mapping with
transparent huge pages where it is advised to (MADV_HUGEPAGE; THP in "madvise" or "always" mode), never torch's own
allocations in "madvise" mode. So a loaded model's converted or quantized block matrices and head are moved into
one such mapping (one for all of them: each rounded to 2 MB on its own would waste up to 4 MB a matrix). Each copy
starts at its source's offset within a 64-byte line, so the kernels take the same paths (decode.cpp aligns some
tiles to the line) and give the same bits; only the page size changes.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
from pathlib import Path

import torch

from .weights import GPT2Weights, PanelMatrix, QuantizedMatrix, libc, release_heap

HUGE_PAGE = 2 << 20  # bytes: x86-64's transparent huge page
LINE = 64  # bytes
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


def move_to_huge_pages(tensors: list[torch.Tensor]) -> None:
    """Move contiguous CPU `tensors` into one anonymous mapping advised as huge pages, each at its old offset within
    a 64-byte line. Each tensor's storage is swapped for its copy (Tensor.set_) as soon as the copy is made, so every
    holder of these tensor objects reads the copy, and the old memory goes tensor by tensor (where nothing else
    holds it): a load's peak grows by one tensor, not by all of them. The mapping lives as long as any of them."""
    starts, end = [], 0
    for t in tensors:
        end += (t.data_ptr() - end) % LINE  # the old offset within a line
        starts.append(end)
        end += t.numel() * t.element_size()
        end += -end % LINE
    size = -(-end // HUGE_PAGE) * HUGE_PAGE
    region = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(region, dtype=torch.uint8)  # [size + 2 MB] bytes, holding `region` alive
    base = -raw.data_ptr() % HUGE_PAGE  # the first 2 MB boundary: a huge page must start on one
    # before the first touch, so that the page faults allocate huge pages (if the advice fails, 4 KB pages: the same
    # values, at the old speed)
    libc().madvise(ctypes.c_void_p(raw.data_ptr() + base), ctypes.c_size_t(size), MADV_HUGEPAGE)
    for t, at in zip(tensors, starts):
        nbytes = t.numel() * t.element_size()
        copy = raw[base + at : base + at + nbytes].view(t.dtype).view(t.shape)
        with torch.no_grad():
            t.set_(copy.copy_(t))
        release_heap()  # the old memory, where it was on the C heap (malloc keeps freed heap pages otherwise)


def matrices_on_huge_pages(w: GPT2Weights, in_place: bool = False) -> None:
    """Move the block matrices and the head of `w` (bfloat16, float32 or packed, with their scales, or panels) onto
    huge pages (move_to_huge_pages), where the system has them; the values, and so every result, stay the same.
    in_place: float32 weights used in place from the checkpoint file, which stay there (the page cache maps the
    file in large physically contiguous folios, which read as fast here, and a copy would add the weights' size to
    the process's memory); only the panels made from them (PanelMatrix) move."""
    if not huge_pages_available():
        return
    matrices = [getattr(b, name).weight for b in w.blocks for name in ("c_attn", "attn_c_proj", "c_fc", "mlp_c_proj")]
    matrices.append(w.head)  # GPT-2's head is wte itself (tied), or its quantized transpose
    tensors = [t for m in matrices for t in ((m.packed, m.scales) if isinstance(m, QuantizedMatrix)
                                             else (m.panels,) if isinstance(m, PanelMatrix)
                                             else () if in_place else (m,))]
    if tensors and all(t.device.type == "cpu" and t.is_contiguous() for t in tensors):
        move_to_huge_pages(list({id(t): t for t in tensors}.values()))
