"""Writes that survive a crash: one file replaced atomically, one output directory swapped in.

Scope: the small state files and whole output directories our commands write (``prepare``'s
``--out``, ``resume``'s record and skip file, the vocab mapping). Each write goes to a temporary
sibling, is fsynced, renamed over its name, and the parent directory is fsynced, so after a crash
(power loss included) the name holds either the old or the new complete content.

A directory swap needs two renames (POSIX has no atomic exchange of non-empty directories). Between
them the old output lives at ``.NAME.previous`` beside ``NAME``; :func:`recover_dir` (called by the
next run before it looks at ``NAME``) moves it back when ``NAME`` is missing, or deletes it when
the swap had finished. Not for files that several processes write at once.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

__all__ = ["fsync_path", "fsync_tree", "previous_path", "recover_dir", "replace_dir", "write_atomic"]


def fsync_path(path: str | os.PathLike) -> None:
    """fsync a file (its contents) or a directory (the renames and creations inside it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str | os.PathLike, data: bytes | str) -> Path:
    """Replace ``path`` with ``data``: temporary sibling, fsync, rename, fsync of the directory."""
    target = Path(path)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    payload = data.encode("utf-8") if isinstance(data, str) else data
    try:
        with open(tmp, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
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
            fsync_path(os.path.join(directory, name))
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
    if not previous.exists():
        return None
    if not target.exists():
        os.rename(previous, target)
        fsync_path(target.parent)
        return f"restored {target} from {previous.name} (an interrupted replace)"
    shutil.rmtree(previous)
    return f"removed {previous.name} (left by an interrupted replace that had finished)"


def replace_dir(staging: str | os.PathLike, target: str | os.PathLike) -> None:
    """Make the finished directory ``staging`` (a sibling of ``target``) be ``target``, crash-safely:
    its files fsynced, the old ``target`` (if any) renamed to ``.NAME.previous``, ``staging`` renamed
    to ``target``, the parent fsynced after each rename, then the old output deleted."""
    staging, target = Path(staging), Path(target)
    parent = target.parent
    recover_dir(target)
    fsync_tree(staging)
    fsync_path(parent)  # the staging directory's own entry
    if target.exists() and target.is_dir() and not any(target.iterdir()):
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
