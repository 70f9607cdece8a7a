"""Writes that survive a crash and refuse links: one file replaced atomically, one directory swapped in.

Scope: every file and output directory our commands write (``prepare``'s ``--out``, the draft export,
``resume``'s record, rendered run files, reports, results). A file is written to a temporary sibling with an
unpredictable name (opened ``O_CREAT|O_EXCL|O_NOFOLLOW``, so a planted link or file there is never followed
or reused), fsynced, renamed over its name, and the parent directory is fsynced: after a crash (power loss
included) the name holds either the old or the new complete content. Its mode is kept (a ``0600`` file stays
``0600``); a new file gets the mode asked for, else the usual ``0666`` less the umask.

Links: a path we write whose last component is a symbolic link is refused with one line that names where it
points (pass that path itself). We never write through a link, and never replace a link with a file or
directory of our own, so a link to a shared directory cannot be emptied, truncated or shadowed by a run.
Links in the parent directories are followed as usual.

A directory is built in a staging sibling (``.NAME.partial-PID-RANDOM``, :func:`staged_dir`) and swapped in
whole: an existing ``NAME`` is never updated file by file. The swap needs two renames (POSIX has no atomic
exchange of non-empty directories); between them the old output lives at ``.NAME.previous`` beside ``NAME``,
and :func:`recover_dir` (called by the next writer before it looks at ``NAME``) moves it back when ``NAME`` is
missing, or deletes it when the swap had finished. Not for files that several processes write at once.

Lock files (:func:`open_lock`) are opened ``O_NOFOLLOW``, mode ``0600``, and must be regular files.
"""

from __future__ import annotations

import errno
import os
import secrets
import shutil
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from specforge_kimi.errors import KimiInputError

__all__ = [
    "fsync_path",
    "fsync_tree",
    "make_staging",
    "open_lock",
    "previous_path",
    "recover_dir",
    "refuse_link",
    "remove_stale_staging",
    "replace_dir",
    "staged_dir",
    "write_atomic",
]

_NEW_FILE_MODE = 0o666  # less the umask, as open() would create it


def fsync_path(path: str | os.PathLike) -> None:
    """fsync a file (its contents) or a directory (the renames and creations inside it)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)  # read-only: following a link here writes nothing
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def refuse_link(path: str | os.PathLike, what: str = "output") -> None:
    """One-line refusal when ``path`` itself is a symbolic link (dangling or not)."""
    if os.path.islink(path):
        real = os.path.realpath(path)
        raise KimiInputError(
            f"{what} {path} is a symbolic link to {real}; refusing to write through or replace a link "
            f"(pass {real} itself)"
        )


def open_lock(path: str | os.PathLike, *, what: str = "lock file") -> int:
    """Open (creating it ``0600``) the lock file ``path`` read-write and return its fd (close-on-exec).
    Never follows a link and never opens anything but a regular file: one-line error for a link, a
    directory, a FIFO or a device. The caller takes the ``flock``."""
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as exc:
        if exc.errno == errno.ELOOP or os.path.islink(path):
            refuse_link(path, what)
        raise KimiInputError(f"cannot open {what} {path}: {exc.strerror}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise KimiInputError(f"{what} {path} is not a regular file; move it away")
    os.set_blocking(fd, True)
    return fd


def _file_mode(target: Path, mode: int | None) -> int | None:
    """The mode the new content gets: ``mode`` if given, else the existing file's (None: a new file,
    created with the umask applied)."""
    if mode is not None:
        return mode
    try:
        st = os.lstat(target)
    except FileNotFoundError:
        return None
    if stat.S_ISDIR(st.st_mode):
        raise KimiInputError(f"{target} is a directory; refusing to replace it with a file")
    return stat.S_IMODE(st.st_mode)


def _open_temporary(target: Path) -> tuple[Path, int]:
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    for _ in range(100):
        tmp = target.with_name(f".{target.name}.{secrets.token_hex(8)}.tmp")
        try:
            return tmp, os.open(tmp, flags, _NEW_FILE_MODE)
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no free temporary name", str(target.parent))


def write_atomic(path: str | os.PathLike, data: bytes | str, *, mode: int | None = None) -> Path:
    """Replace ``path`` with ``data``: an ``O_EXCL`` temporary sibling, fsync, rename, fsync of the
    directory. ``mode``: for a new file (default: ``0666`` less the umask); an existing file's mode is kept
    unless ``mode`` is given. Refuses a ``path`` that is a link or a directory."""
    target = Path(path)
    refuse_link(target)
    want = _file_mode(target, mode)
    payload = data.encode("utf-8") if isinstance(data, str) else data
    tmp, fd = _open_temporary(target)
    try:
        try:
            if want is not None:
                os.fchmod(fd, want)
            view = memoryview(payload)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(target.parent)
    return target


def fsync_tree(root: str | os.PathLike) -> None:
    """fsync every file and directory under ``root`` (a finished staging directory before its rename)."""
    for directory, _dirs, files in os.walk(root, topdown=False):
        for name in files:
            path = os.path.join(directory, name)
            if not os.path.islink(path):
                fsync_path(path)
        fsync_path(directory)


def previous_path(target: str | os.PathLike) -> Path:
    """Where the old output waits during a swap: ``.NAME.previous`` beside ``NAME``."""
    target = Path(target)
    return target.parent / f".{target.name}.previous"


def recover_dir(target: str | os.PathLike) -> str | None:
    """Finish a swap a crash interrupted; returns what was done (None: nothing to do). ``NAME``
    missing and ``.NAME.previous`` there: the old output is moved back. Both there: the swap had
    finished, the old copy goes."""
    target = Path(target)
    previous = previous_path(target)
    if not os.path.lexists(previous):
        return None
    refuse_link(previous, "leftover")
    if not os.path.lexists(target):
        os.rename(previous, target)
        fsync_path(target.parent)
        return f"restored {target} from {previous.name} (an interrupted replace)"
    shutil.rmtree(previous)
    return f"removed {previous.name} (left by an interrupted replace that had finished)"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_staging(target: str | os.PathLike) -> list[Path]:
    """Delete the staging directories (``.NAME.partial-PID...``) of writers of ``target`` that no longer
    run; returns them. Links and entries that are not directories are left alone."""
    target = Path(target)
    removed = []
    if not target.parent.is_dir():
        return removed
    for path in target.parent.glob(f".{target.name}.partial-*"):
        pid = path.name.removeprefix(f".{target.name}.partial-").split("-", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid() or _alive(int(pid)):
            continue
        if path.is_symlink() or not path.is_dir():
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def make_staging(target: str | os.PathLike) -> Path:
    """A new, empty staging directory beside ``target`` (``.NAME.partial-PID-RANDOM``; ``mkdir`` never
    follows or reuses what is there)."""
    target = Path(target)
    for _ in range(100):
        staging = target.parent / f".{target.name}.partial-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            staging.mkdir()
            return staging
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no free staging name", str(target.parent))


def replace_dir(staging: str | os.PathLike, target: str | os.PathLike) -> None:
    """Make the finished directory ``staging`` (a sibling of ``target``) be ``target``, crash-safely:
    its files fsynced, the old ``target`` (if any) renamed to ``.NAME.previous``, ``staging`` renamed
    to ``target``, the parent fsynced after each rename, then the old output deleted. Refuses a
    ``target`` that is a link or not a directory."""
    staging, target = Path(staging), Path(target)
    parent = target.parent
    refuse_link(target)
    recover_dir(target)
    if os.path.lexists(target) and not target.is_dir():
        raise KimiInputError(f"{target} exists and is not a directory; refusing to replace it")
    fsync_tree(staging)
    fsync_path(parent)  # the staging directory's own entry
    if target.exists() and not any(target.iterdir()):
        target.rmdir()
    if not target.exists():
        os.rename(staging, target)
        fsync_path(parent)
        return
    previous = previous_path(target)
    os.rename(target, previous)
    fsync_path(parent)
    os.rename(staging, target)
    fsync_path(parent)
    shutil.rmtree(previous, ignore_errors=True)


@contextmanager
def staged_dir(target: str | os.PathLike) -> Iterator[Path]:
    """Build the directory ``target`` whole: yields a fresh staging sibling to write into; on a normal
    exit it replaces ``target`` (:func:`replace_dir`), on any exception it is deleted and ``target``
    is left as it was. Refuses a ``target`` that is a link, before anything is written."""
    target = Path(target)
    refuse_link(target)
    if os.path.lexists(target) and not target.is_dir():
        raise KimiInputError(f"{target} exists and is not a directory; refusing to replace it")
    recover_dir(target)
    remove_stale_staging(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = make_staging(target)
    try:
        yield staging
        replace_dir(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
