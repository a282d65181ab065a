"""The matrices a decode step streams, on 2 MB pages.

Why: a decode step reads every weight once, a few hundred MB, and on 4 KB pages each 64 lines of it need a
translation of their own, whose page walks sit in the memory stream: on an AVX2 EPYC, a bfloat16, int8 or int4
decode step runs faster with its matrices on 2 MB pages (docs/benchmarks.md). Linux backs an anonymous mapping with
transparent huge pages where it is advised to (MADV_HUGEPAGE; THP in "madvise" or "always" mode), never torch's own
allocations in "madvise" mode. So a loaded model's converted or quantized block matrices and head are copied into
one such mapping (one for all of them: each rounded to 2 MB on its own would waste up to 4 MB a matrix). Each copy
starts at its source's offset within a 64-byte line, so the kernels take the same paths (decode.cpp aligns some
tiles to the line) and give the same bits; only the page size changes.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
from dataclasses import replace
from pathlib import Path

import torch

from .weights import GPT2Weights, QuantizedMatrix, libc

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


def on_huge_pages(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of contiguous CPU `tensors` in one anonymous mapping advised as huge pages, each at its source's offset
    within a 64-byte line. The mapping lives as long as any of the copies."""
    starts, end = [], 0
    for t in tensors:
        end += (t.data_ptr() - end) % LINE  # the source's offset within a line
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
    copies = []
    for t, at in zip(tensors, starts):
        nbytes = t.numel() * t.element_size()
        copy = raw[base + at : base + at + nbytes].view(t.dtype).view(t.shape)
        copies.append(copy.copy_(t))
    return copies


def matrices_on_huge_pages(w: GPT2Weights) -> GPT2Weights:
    """`w` with its block matrices and head (bfloat16, float32 or packed, with their scales) copied onto huge pages
    (on_huge_pages), where the system has them; else `w` itself. For weights already in anonymous memory (converted
    to bfloat16, quantized, read from another format): the old copies are freed when `w` is, so the load's peak
    holds both for a moment. Float32 weights used in place from the checkpoint file stay there (GPT2.from_pretrained
    does not call this for them): the page cache maps the file in large physically contiguous folios, which read as
    fast here, and a copy would double the resident memory."""
    if not huge_pages_available():
        return w
    names = ("c_attn", "attn_c_proj", "c_fc", "mlp_c_proj")

    def parts(m: torch.Tensor | QuantizedMatrix) -> list[torch.Tensor]:
        return [m.packed, m.scales] if isinstance(m, QuantizedMatrix) else [m]

    tensors = [t for b in w.blocks for name in names for t in parts(getattr(b, name).weight)] + parts(w.head)
    if not all(t.device.type == "cpu" and t.is_contiguous() for t in tensors):
        return w
    placed = iter(on_huge_pages(tensors))

    def moved(m: torch.Tensor | QuantizedMatrix) -> torch.Tensor | QuantizedMatrix:
        if isinstance(m, QuantizedMatrix):
            return replace(m, packed=next(placed), scales=next(placed))
        return next(placed)

    blocks = tuple(replace(b, **{name: replace(getattr(b, name), weight=moved(getattr(b, name).weight))
                                 for name in names}) for b in w.blocks)
    head = moved(w.head)
    tied = w.head is w.wte  # GPT-2's head is wte itself: one copy serves the embedding too
    return replace(w, blocks=blocks, head=head, wte=head if tied else w.wte)
