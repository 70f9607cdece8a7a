"""``regenerate``'s output files: checked before anything is written, locked, appended to in whole lines.

Scope: a JSONL file that one process appends to (``--out`` and its errors file). :func:`check_output`
refuses, in one line, a path that is the input (through a link too), a symbolic link, a directory or
anything but a regular file, or one whose directory is missing or not writable. :class:`OutputLock`
holds ``OUT.lock`` (``flock``: the kernel drops it when the process dies, however it dies) so that a
second run on the same output refuses at once, naming the holder's pid; the lock file is opened with
``O_NOFOLLOW`` and refused unless it is a regular file with one link, so a link planted there is never
written through, and it is removed on release. :class:`LineWriter` appends whole lines; a run that is
interrupted cuts its file back to the end of the last line written whole.
"""

from __future__ import annotations

import errno
import os
import stat
import time
from pathlib import Path

from specforge_kimi.errors import KimiInputError

__all__ = ["LineWriter", "OutputLock", "check_output", "open_no_follow"]

_NO_FOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC


def check_output(path: Path, what: str, input_path: Path) -> None:
    """Refuse (one line) an output ``path`` that writing would turn against the user."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    except OSError as exc:  # a file where a directory should be (ENOTDIR), a name too long, ...
        raise KimiInputError(f"{what} {path}: {exc.strerror}") from None
    if st is not None:
        if path.exists() and os.path.samefile(path, input_path):
            raise KimiInputError(
                f"{what} {path} is the input file {input_path}; writing it would destroy the input: "
                "choose another --out"
            )
        if stat.S_ISLNK(st.st_mode):
            target = os.readlink(path)
            dangling = "" if path.exists() else ", which does not exist"
            raise KimiInputError(f"{what} {path} is a symbolic link (to {target}{dangling}); name a regular file")
        if stat.S_ISDIR(st.st_mode):
            raise KimiInputError(f"{what} {path} is a directory; name a file")
        if not stat.S_ISREG(st.st_mode):
            raise KimiInputError(f"{what} {path} is not a regular file")
        if not os.access(path, os.W_OK):
            raise KimiInputError(f"{what} {path} is not writable")
    parent = path.parent
    if not parent.is_dir():
        raise KimiInputError(f"{what} {path}: the directory {parent} does not exist; create it first")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise KimiInputError(f"{what} {path}: cannot create files in {parent} (permission denied)")


def open_no_follow(path: Path, flags: int, what: str) -> int:
    """``os.open`` of a regular file with ``O_NOFOLLOW`` (and ``O_NONBLOCK``: a FIFO put there since it was
    checked fails instead of blocking); a link, anything but a regular file or an unwritable path is one
    line, not a traceback."""
    try:
        fd = os.open(path, flags | _NO_FOLLOW | os.O_NONBLOCK, 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise KimiInputError(f"{what} {path} is a symbolic link; remove it") from None
        raise KimiInputError(f"cannot open {what} {path}: {exc.strerror}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise KimiInputError(f"{what} {path} is not a regular file")
    return fd


class OutputLock:
    """``OUT.lock`` held for as long as this object is entered: one writer per output."""

    def __init__(self, path: Path, output: Path) -> None:
        self.path = path
        self.output = output
        self._fd: int | None = None

    def __enter__(self) -> OutputLock:
        import fcntl

        for _ in range(16):
            fd = open_no_follow(self.path, os.O_RDWR | os.O_CREAT, "the lock file")
            try:
                st = os.fstat(fd)
                if st.st_nlink != 1:  # a hard link to another file: truncating it would truncate that file
                    raise KimiInputError(f"the lock file {self.path} has other names (hard links); remove it")
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    holder = _holder(fd)
                    raise KimiInputError(
                        f"{self.output} is being written by another regenerate (pid {holder}, holding {self.path}); "
                        f"wait for it or stop it (kill -INT {holder})"
                    ) from None
            except BaseException:
                os.close(fd)
                raise
            try:
                now = os.lstat(self.path)
            except FileNotFoundError:
                now = None
            if now is not None and (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
                break
            os.close(fd)  # the holder removed the file as it released it: lock the one at the path now
        else:
            raise KimiInputError(f"cannot take the lock {self.path}: it keeps being replaced")
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            try:
                os.unlink(self.path)  # while still held: a run waiting on this file retries on the new one
            except FileNotFoundError:
                pass
            os.close(self._fd)
            self._fd = None


def _holder(fd: int) -> str:
    for _ in range(20):  # the holder writes its pid right after it takes the lock
        pid = os.pread(fd, 32, 0).decode(errors="replace").strip()
        if pid:
            return pid
        time.sleep(0.01)
    return "unknown"


class LineWriter:
    """Appends whole lines to ``path`` (opened ``O_NOFOLLOW``), after cutting it to ``keep`` bytes.
    ``end`` is where the last line written whole ends; :meth:`close` with ``whole=False`` cuts the
    file back to it (a line half-written when the run was interrupted)."""

    def __init__(self, path: Path, what: str, *, keep: int = 0) -> None:
        self._fd = open_no_follow(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, what)
        os.ftruncate(self._fd, keep)
        self.end = keep

    def write_line(self, text: str) -> None:
        data = memoryview((text + "\n").encode("utf-8"))
        size = len(data)
        while data:
            data = data[os.write(self._fd, data) :]
        self.end += size

    def close(self, *, whole: bool = True) -> None:
        if self._fd < 0:
            return
        try:
            if not whole:
                os.ftruncate(self._fd, self.end)
        finally:
            os.close(self._fd)
            self._fd = -1
