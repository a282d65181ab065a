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
import functools
import os
import math
import mmap
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from .config import GPT2Config, memory_left
from .errors import GPT2EngineError

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


def available_memory() -> int:
    """Bytes this process may still fill without swapping: Linux's MemAvailable, within the cgroup's memory limit where
    one is set (a container's); elsewhere the physical memory. What a command checks a large allocation against."""
    try:
        free = int(Path("/proc/meminfo").read_text().split("MemAvailable:")[1].split()[0]) * 1024
    except (OSError, IndexError, ValueError):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            free = min(free, int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text()))
    except (OSError, ValueError):
        pass  # no cgroup v2 limit here
    return free


def check_batch_fits(batch_size: int, context: int, config: GPT2Config, extra_per_token: int = 0,
                     ids: bool = False) -> None:
    """Refuse, before anything is allocated, a pass of `batch_size` windows of `context` tokens whose activations
    cannot fit in the memory this process has: per token the residual stream, q, k, v and the MLP's hidden layer
    (about 12 x n_embd floats), a row of attention scores per head, and `extra_per_token` floats (an SAE's latents,
    the logits). The message names the command line's flags, or with `ids` the Python API's ids [B, T]."""
    room = min(available_memory(), memory_left())
    window = 4 * context * (12 * config.n_embd + config.n_head * context + extra_per_token)  # bytes
    if batch_size * window > room:
        fits = room // window
        need = f"~{batch_size * window / 1e9:,.1f} GB for a forward pass's activations; this process has " \
               f"{room / 1e9:.1f} GB available"
        if ids:
            raise GPT2EngineError(f"ids of shape [{batch_size}, {context}] need {need}: "
                                  f"{f'at most {fits} rows fit' if fits else 'use fewer tokens'}")
        raise GPT2EngineError(f"--batch-size {batch_size} x --context {context} needs {need}: "
                              f"{f'at most --batch-size {fits} fits' if fits else 'lower --context'}")


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


# --- the checkpoint file's pages under tensors read in place ----------------------------------------------------

@dataclass(frozen=True)
class FilePages:
    """The pages under a tensor that lies in a read-only memory mapping of the checkpoint file (file_pages() checks
    that). Releasing them loses nothing: a later access reads them from the file again."""

    start: int  # the checked tensor's first byte
    end: int  # one past its last byte
    path: str = ""  # the mapped file
    offset: int = 0  # where in it the checked tensor's first byte is
    inode: tuple[int, int] = (0, 0)  # (device, inode) of that file when it was checked

    def read_rows(self, table: torch.Tensor, ids: list[int]) -> torch.Tensor | None:
        """Rows `ids` of `table` (a contiguous 2-D tensor within the checked one) as [n, C], read from the file with
        pread instead of through the mapping: nothing gets mapped, so there is nothing to release afterwards (a
        release and the page fault of the next read cost ~0.3 ms a decode step). None where that cannot be done,
        or where the file at `path` is no longer the one mapped (replaced on disk since)."""
        first = table.data_ptr()
        if not self.path or table.dim() != 2 or not table.is_contiguous() or not self.start <= first < self.end:
            return None
        for t in ids:
            if not 0 <= t < table.shape[0]:
                raise IndexError(f"index {t} is out of bounds for {table.shape[0]} rows")
        out = torch.empty(len(ids), table.shape[1], dtype=table.dtype)  # [n, C]
        row_bytes = table.shape[1] * table.element_size()
        view = memoryview(out.view(torch.uint8).numpy()).cast("B")
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError:
            return None
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != self.inode:
                return None
            for i, t in enumerate(ids):
                at = self.offset + first - self.start + t * row_bytes
                if os.preadv(fd, [view[i * row_bytes : (i + 1) * row_bytes]], at) != row_bytes:
                    return None
        finally:
            os.close(fd)
        return out

    def within(self, tensor: torch.Tensor) -> FilePages | None:
        """The pages under `tensor`, if it is contiguous and lies within these (None otherwise)."""
        first = tensor.data_ptr()
        end = first + tensor.numel() * tensor.element_size()
        if tensor.device.type != "cpu" or not tensor.is_contiguous() or not self.start <= first <= end <= self.end:
            return None
        return FilePages(first, end, self.path, self.offset + first - self.start, self.inode)

    def release(self, tensor: torch.Tensor) -> bool:
        """Drop this process's resident pages under `tensor` (madvise DONTNEED, ~10 us); False, leaving it alone,
        unless it is contiguous and lies within the checked tensor (not a copy, not on another device)."""
        if self.within(tensor) is None:
            return False
        first, end = tensor.data_ptr(), tensor.data_ptr() + tensor.numel() * tensor.element_size()
        first = max(self.start - self.start % mmap.PAGESIZE, first - first % mmap.PAGESIZE)
        return libc().madvise(ctypes.c_void_p(first), ctypes.c_size_t(end - first), MADV_DONTNEED) == 0


@functools.cache
def libc() -> ctypes.CDLL:
    """The C library, loaded once per process (a dlopen for each madvise cost more than the madvise)."""
    return ctypes.CDLL(None, use_errno=True)


MADV_DONTNEED = 4  # Linux


def release_pages(tensor: torch.Tensor, source: Path) -> bool:
    """Drop this process's resident pages under `tensor` if it lies in a memory mapping of the file `source`
    (a checkpoint read in place); True if it did. Such pages are clean copies of the file: a later access reads them
    again, so nothing is lost, and a quantized model does not keep the float32 weights it no longer reads in memory.
    The pages at either end may hold neighbouring tensors; they are file pages too and come back the same way.
    Anything not mapped from `source` (a copy, anonymous memory) is left alone, since dropping it would lose data.
    """
    pages = file_pages(tensor, source)
    return pages is not None and pages.release(tensor)


def file_pages(tensor: torch.Tensor, source: Path) -> FilePages | None:
    """The pages under `tensor` if it lies in a memory mapping of the file `source`, else None (read from
    /proc/self/maps, ~1 ms: check once, release often; file_mapping, then FilePages.within, for many tensors)."""
    mapping = file_mapping(tensor, source)
    return None if mapping is None else mapping.within(tensor)


def file_mapping(tensor: torch.Tensor, source: Path) -> FilePages | None:
    """The pages of the whole memory mapping of the file `source` that `tensor` lies in, else None."""
    if sys.platform != "linux" or tensor.numel() == 0 or not tensor.is_contiguous() or tensor.device.type != "cpu":
        return None
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return None
    target = str(source.resolve())
    for line in maps:
        fields = line.split(maxsplit=5)
        low, high = (int(a, 16) for a in fields[0].split("-"))
        if low <= start and end <= high:
            if len(fields) < 6 or fields[5] != target:
                return None
            try:
                st = os.stat(target)
            except OSError:
                return None
            return FilePages(low, high, target, int(fields[2], 16), (st.st_dev, st.st_ino))
    return None


def release_heap() -> None:
    """Return the C heap's free pages to the system (glibc's malloc_trim; nothing elsewhere). Quantizing frees
    temporaries of a few MB between the quantized matrices it keeps: glibc's mmap threshold has by then grown past
    their size, so they live on the heap and, without this, stay resident (about 17 MB after an int4 load)."""
    if sys.platform == "linux":
        libc = ctypes.CDLL(None)
        if hasattr(libc, "malloc_trim"):
            libc.malloc_trim(ctypes.c_size_t(0))

