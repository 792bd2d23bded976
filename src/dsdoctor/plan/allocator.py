"""A model of PyTorch's CUDA caching allocator (``c10/cuda/CUDACachingAllocator.cpp``): it rounds requests (to
512 bytes; segments of 2 MiB for requests up to 1 MiB, 20 MiB for requests under 10 MiB, larger ones rounded to
2 MiB), serves a request from the smallest cached free block that fits (among equal fits the lowest address; the
driver maps new segments below the old ones, so the newest serves first), splits it (large pool: when more than
1 MiB would remain), merges neighbours when freed, and asks CUDA for a new segment when no free block fits. With
``expandable_segments:True`` a pool is one segment that grows by mapping 2 MiB pages. ``reserved.py`` feeds
it the allocations of a run."""
from __future__ import annotations

import bisect
import math

KiB, MiB = 1024, 1024**2
SMALL_REQUEST = 1 * MiB  # kSmallSize
SMALL_SEGMENT = 2 * MiB  # kSmallBuffer
LARGE_SEGMENT = 20 * MiB  # kLargeBuffer
MIN_LARGE_ALLOC = 10 * MiB  # kMinLargeAlloc
ROUND_LARGE = 2 * MiB  # kRoundLarge
PAGE = 2 * MiB  # expandable segments map 2 MiB pages


def round_size(n: int) -> int:
    return 512 if n < 512 else 512 * math.ceil(n / 512)


def segment_size(n: int) -> int:
    if n <= SMALL_REQUEST:
        return SMALL_SEGMENT
    if n < MIN_LARGE_ALLOC:
        return LARGE_SEGMENT
    return ROUND_LARGE * math.ceil(n / ROUND_LARGE)


class Allocator:
    """The caching allocator's block bookkeeping (no release to CUDA: the GPU is never full here).

    Free blocks of a pool (small/large, per stream) sit in a list sorted by (size, segment, address), so a
    best-fit lookup is one bisection, as the allocator's own ordered set does."""

    def __init__(self, expandable: bool = False):
        self.expandable = expandable
        self.free: dict = {}  # (small pool, stream) -> sorted [(size, segment, addr)]
        self.free_at: dict = {}  # (segment, addr) -> size, free blocks
        self.free_end: dict = {}  # (segment, end address) -> addr, free blocks
        self.live: dict = {}  # id -> (pool key, segment, addr, size)
        self.seg_end: dict = {}
        self.reserved = 0
        self.peak_reserved = 0
        self.allocated = 0
        self._next_seg = 0
        self._grow: dict = {}  # expandable: the one segment per pool
        self.deferred: dict = {}  # id -> bytes: released by the program, not yet reusable (record_stream)
        self.deferred_bytes = 0
        self.peak_live = 0  # allocated minus deferred: what max_memory_allocated counts

    def _add_free(self, pool, seg, addr, size):
        bisect.insort(pool, (size, seg, addr))
        self.free_at[(seg, addr)] = size
        self.free_end[(seg, addr + size)] = addr

    def _del_free(self, pool, seg, addr):
        size = self.free_at.pop((seg, addr))
        del self.free_end[(seg, addr + size)]
        i = bisect.bisect_left(pool, (size, seg, addr))
        del pool[i]
        return size

    def _new_segment(self, size: int) -> int:
        self._next_seg -= 1  # below every older segment: sorts first among equal sizes
        seg = self._next_seg
        self.seg_end[seg] = size
        self.reserved += size
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return seg

    def malloc(self, tid: int, nbytes: int, stream: int = 0) -> None:
        size = round_size(nbytes)
        small = size <= SMALL_REQUEST
        key = (small, stream)
        pool = self.free.setdefault(key, [])
        i = bisect.bisect_left(pool, (size, -math.inf, -1))
        if i < len(pool):
            bsize, seg, addr = pool[i]
        elif self.expandable:
            seg = self._grow.get(key)
            if seg is None:
                seg = self._grow[key] = self._new_segment(0)
            end = self.seg_end[seg]
            tail = self.free_end.get((seg, end))
            have = self._del_free(pool, seg, tail) if tail is not None else 0
            grow = PAGE * math.ceil((size - have) / PAGE)
            self.seg_end[seg] = end + grow
            self.reserved += grow
            self.peak_reserved = max(self.peak_reserved, self.reserved)
            addr = tail if tail is not None else end
            self._add_free(pool, seg, addr, have + grow)
            bsize = have + grow
        else:
            seg = self._new_segment(segment_size(size))
            addr, bsize = 0, self.seg_end[seg]
            self._add_free(pool, seg, addr, bsize)
        self._del_free(pool, seg, addr)
        rest = bsize - size
        if rest >= (512 if small else SMALL_REQUEST + 1):
            self._add_free(pool, seg, addr + size, rest)
        else:
            size = bsize
        self.live[tid] = (key, seg, addr, size)
        self.allocated += size
        self.peak_live = max(self.peak_live, self.allocated - self.deferred_bytes)

    def defer(self, tid) -> None:
        """The program has released ``tid``; its block stays taken until ``release`` (its stream's event)."""
        got = self.live.get(tid)
        if got is not None and tid not in self.deferred:
            self.deferred[tid] = got[3]
            self.deferred_bytes += got[3]

    def release(self, tid: int) -> None:
        got = self.live.pop(tid, None)
        if got is None:
            return
        self.deferred_bytes -= self.deferred.pop(tid, 0)
        key, seg, addr, size = got
        self.allocated -= size
        pool = self.free[key]
        if (seg, addr + size) in self.free_at:  # merge with the next free block
            size += self._del_free(pool, seg, addr + size)
        prev = self.free_end.get((seg, addr))
        if prev is not None:  # and with the previous one
            size += self._del_free(pool, seg, prev)
            addr = prev
        self._add_free(pool, seg, addr, size)
