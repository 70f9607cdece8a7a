"""Byte ranges of the cuda_ipc pool: which part of the server's one GPU buffer holds which sample.

Scope: bookkeeping only, in the capture server's process (the sink thread; not thread-safe by itself). First
fit over a free list kept sorted by offset, neighbours coalesced on free, every range a multiple of ``align``
bytes so each feature's view starts aligned for any dtype. Samples are released roughly in the order they were
captured (the trainer acknowledges optimizer windows in order), so first fit keeps the free space at the pool's
end in one piece most of the time.
"""

from __future__ import annotations

import bisect


def aligned(nbytes: int, align: int) -> int:
    """``nbytes`` rounded up to a multiple of ``align``."""
    return -(-int(nbytes) // align) * align


class RegionAllocator:
    """First-fit allocator over ``[0, capacity)``."""

    def __init__(self, capacity: int, *, align: int = 256) -> None:
        if capacity <= 0 or align <= 0 or capacity % align:
            raise ValueError(f"capacity {capacity} must be a positive multiple of align {align}")
        self.capacity = int(capacity)
        self.align = int(align)
        self._starts: list[int] = [0]  # free ranges, sorted by start
        self._sizes: list[int] = [self.capacity]
        self._used: dict[int, int] = {}  # start -> size of each allocated range

    def alloc(self, nbytes: int) -> int | None:
        """The start of a free range of ``aligned(nbytes)`` bytes (at least one ``align``), or None if none fits."""
        size = aligned(max(int(nbytes), 1), self.align)
        for i, free in enumerate(self._sizes):
            if free >= size:
                start = self._starts[i]
                if free == size:
                    del self._starts[i], self._sizes[i]
                else:
                    self._starts[i] += size
                    self._sizes[i] -= size
                self._used[start] = size
                return start
        return None

    def free(self, start: int) -> int:
        """Give the range that :meth:`alloc` returned at ``start`` back; returns its size."""
        size = self._used.pop(start, None)
        if size is None:
            raise KeyError(f"no allocated range starts at {start}")
        freed = size
        i = bisect.bisect_left(self._starts, start)
        # coalesce with the free range after it, then with the one before it
        if i < len(self._starts) and start + size == self._starts[i]:
            size += self._sizes[i]
            del self._starts[i], self._sizes[i]
        if i > 0 and self._starts[i - 1] + self._sizes[i - 1] == start:
            self._sizes[i - 1] += size
        else:
            self._starts.insert(i, start)
            self._sizes.insert(i, size)
        return freed

    @property
    def used_bytes(self) -> int:
        return sum(self._used.values())

    @property
    def free_bytes(self) -> int:
        return sum(self._sizes)

    @property
    def largest_free(self) -> int:
        return max(self._sizes, default=0)

    def ranges(self) -> list[tuple[int, int]]:
        """The free ranges as ``(start, size)``, by start (for tests and logs)."""
        return list(zip(self._starts, self._sizes, strict=True))
