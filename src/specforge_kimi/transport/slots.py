"""The release channel of the cuda_ipc transport: a slot table the capture server and every reader map.

Scope: processes of one host. The table is an ``np.memmap`` of a small file (under ``/dev/shm`` where it
exists; ``multiprocessing.shared_memory`` is not used because Python 3.11's resource tracker unlinks a segment
when any attaching process exits). Row 0 is a header (magic, version, rows, pool bytes, the writer's pid); rows
``1..max_slots`` are slots of ``COLUMNS`` int64 each.

Who writes what: the server (one writer thread) owns every column but ``release``: when it lends a region to a
sample it writes the row's key, offset, size and time, resets ``release`` and writes ``alloc`` last (a fresh,
monotonic id; 0 marks a free row). A reader (the producer, a trainer rank) that is done with a sample writes
``release = alloc`` -- nothing else, no lock, no message to the server. The server frees a row when it sees
``release == alloc`` (or when the row outlived its lease) by writing ``alloc = 0``. A reader checks ``alloc``
before and after it copies a sample out, so a slot reclaimed under it is seen and refused, never read half-new.
Aligned 8-byte stores are single stores on the hosts this runs on; each field has one writer at a time.

The table, like the pool's other files, is created owner-only (0600 whatever the umask) with ``O_EXCL |
O_NOFOLLOW``: a link or file already at the path makes creation fail, never writes through it.
"""

from __future__ import annotations

import errno
import hashlib
import os
from pathlib import Path

MAGIC = 0x5346_4B49_5043_0001  # "SFKIPC" v1
VERSION = 1
COLUMNS = 8
ALLOC, RELEASE, KEY, OFFSET, NBYTES, T_ALLOC_NS = range(6)
_H_MAGIC, _H_VERSION, _H_ROWS, _H_CAPACITY, _H_PID = range(5)


def sample_key(sample_id: str) -> int:
    """A positive 63-bit key for ``sample_id`` (rows carry it so a sample can be found without its descriptor)."""
    return int.from_bytes(hashlib.blake2b(str(sample_id).encode(), digest_size=8).digest(), "little") >> 1


def shm_dir() -> Path:
    """``/dev/shm`` where the host has it (memory, not disk), else the temporary directory."""
    import tempfile

    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def create_private_file(path: str | os.PathLike, nbytes: int):
    """A new file of ``nbytes`` zero bytes at ``path``, mode 0600, opened ``r+b``; refuses (``FileExistsError``)
    whatever is at ``path`` already -- a link planted there included -- instead of following or truncating it."""
    path = Path(path)
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags, 0o600)
    except FileExistsError:
        kind = "a symbolic link" if path.is_symlink() else "a file"
        raise FileExistsError(
            errno.EEXIST, f"cuda_ipc: {path} is already {kind}; refusing to create the pool's file through it"
        ) from None
    try:
        os.fchmod(fd, 0o600)  # O_CREAT's mode is already masked by the umask; this only states it
        os.ftruncate(fd, int(nbytes))
        return os.fdopen(fd, "r+b")
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise


def open_existing(path: str | os.PathLike):
    """``path`` opened ``r+b`` without following a link at it (a reader's side of :func:`create_private_file`)."""
    try:
        fd = os.open(path, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ValueError(f"cuda_ipc: {path} is a symbolic link; refusing to map it") from None
        raise
    return os.fdopen(fd, "r+b")


class SlotTable:
    """One pool's slot table; :meth:`create` (server) or :meth:`attach` (reader)."""

    def __init__(self, path: Path, rows) -> None:
        self.path = Path(path)
        self._a = rows
        self.max_slots = int(rows.shape[0]) - 1
        self.capacity = int(rows[0, _H_CAPACITY])
        self._cursor = 1

    @classmethod
    def create(cls, path: str | os.PathLike, *, max_slots: int, capacity: int) -> SlotTable:
        import numpy as np

        if max_slots < 1:
            raise ValueError(f"max_slots must be >= 1, not {max_slots}")
        path = Path(path)
        shape = (max_slots + 1, COLUMNS)
        with create_private_file(path, shape[0] * shape[1] * 8) as f:
            rows = np.memmap(f, dtype=np.int64, mode="r+", shape=shape)
        rows[0, _H_VERSION] = VERSION
        rows[0, _H_ROWS] = max_slots
        rows[0, _H_CAPACITY] = int(capacity)
        rows[0, _H_PID] = os.getpid()
        rows[0, _H_MAGIC] = MAGIC  # last: a reader that sees the magic sees the rest
        rows.flush()
        return cls(path, rows)

    @classmethod
    def attach(cls, path: str | os.PathLike) -> SlotTable:
        import numpy as np

        path = Path(path)
        with open_existing(path) as f:
            raw = f.read(COLUMNS * 8)
            head = np.frombuffer(raw[: len(raw) // 8 * 8], dtype=np.int64)
            if head.size < COLUMNS or int(head[_H_MAGIC]) != MAGIC or int(head[_H_VERSION]) != VERSION:
                raise ValueError(f"{path} is not a specforge-kimi slot table (v{VERSION})")
            rows = np.memmap(f, dtype=np.int64, mode="r+", shape=(int(head[_H_ROWS]) + 1, COLUMNS))
        return cls(path, rows)

    @property
    def writer_pid(self) -> int:
        return int(self._a[0, _H_PID])

    # -- the server's side -------------------------------------------------------------------------------------
    def claim(self, *, alloc_id: int, key: int, offset: int, nbytes: int, t_ns: int) -> int | None:
        """Write a lent region into a free row (round robin from the last one, so a row is reused as late as
        possible); returns the slot, or None when every row is lent."""
        if alloc_id <= 0:
            raise ValueError(f"alloc ids are positive, not {alloc_id}")
        import numpy as np

        a = self._a
        free = np.flatnonzero(a[1:, ALLOC] == 0) + 1
        if not free.size:
            return None
        later = free[free >= self._cursor]
        slot = int(later[0] if later.size else free[0])
        a[slot, KEY] = key
        a[slot, OFFSET] = offset
        a[slot, NBYTES] = nbytes
        a[slot, T_ALLOC_NS] = t_ns
        a[slot, RELEASE] = 0
        a[slot, ALLOC] = alloc_id  # last: the row is live from here
        self._cursor = slot % self.max_slots + 1
        return slot

    def free(self, slot: int) -> None:
        self._a[slot, ALLOC] = 0

    def released(self) -> list[int]:
        """Live slots whose reader wrote ``release == alloc``."""
        import numpy as np

        body = self._a[1:]
        return [int(i) + 1 for i in np.nonzero((body[:, ALLOC] != 0) & (body[:, RELEASE] == body[:, ALLOC]))[0]]

    # -- a reader's side ---------------------------------------------------------------------------------------
    def current(self, slot: int) -> int:
        """The row's alloc id now (0: free)."""
        return int(self._a[slot, ALLOC])

    def release(self, slot: int, alloc_id: int) -> bool:
        """Release ``slot`` if it still holds ``alloc_id``; False when the server reclaimed it already."""
        if not 1 <= slot <= self.max_slots:
            raise ValueError(f"slot {slot} outside 1..{self.max_slots}")
        if int(self._a[slot, ALLOC]) != alloc_id:
            return False
        self._a[slot, RELEASE] = alloc_id
        return True

    def region(self, slot: int) -> tuple[int, int]:
        """``(offset, nbytes)`` of the pool region the server lent with ``slot`` (read it while ``current(slot)``
        is the alloc id in question, and check that again after)."""
        return int(self._a[slot, OFFSET]), int(self._a[slot, NBYTES])

    def find(self, key: int) -> list[tuple[int, int]]:
        """``(slot, alloc_id)`` of every live, unreleased row carrying ``key``.

        The server may free and re-lend a row while this reads it, so the key is read between two snapshots of
        the alloc column and a row counts only where both show the same id: the server writes a row's key before
        it publishes a (new, larger) alloc id, so an id that did not change under the read owns the key read.
        Releasing with that id then cannot touch a new occupant (:meth:`release` checks it)."""
        import numpy as np

        before = np.array(self._a[1:, ALLOC])
        keys = np.array(self._a[1:, KEY])
        released = np.array(self._a[1:, RELEASE])
        after = np.array(self._a[1:, ALLOC])
        hit = np.nonzero((keys == key) & (before != 0) & (before == after) & (released != before))[0]
        return [(int(i) + 1, int(before[i])) for i in hit]

    def live(self) -> dict:
        """Lent rows now: how many, their bytes, the oldest one's allocation time (ns, wall clock)."""

        body = self._a[1:]
        mask = (body[:, ALLOC] != 0) & (body[:, RELEASE] != body[:, ALLOC])
        return {
            "slots": int(mask.sum()),
            "bytes": int(body[mask, NBYTES].sum()),
            "oldest_t_ns": int(body[mask, T_ALLOC_NS].min()) if mask.any() else None,
        }

    def row(self, slot: int) -> dict:
        r = self._a[slot]
        return {
            "alloc": int(r[ALLOC]),
            "release": int(r[RELEASE]),
            "key": int(r[KEY]),
            "offset": int(r[OFFSET]),
            "nbytes": int(r[NBYTES]),
        }

    def close(self) -> None:
        mm = getattr(self._a, "_mmap", None)
        self._a = None
        if mm is not None:
            try:
                mm.close()
            except (BufferError, ValueError):
                pass
