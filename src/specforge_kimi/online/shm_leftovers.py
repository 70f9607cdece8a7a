"""What the capture server's and the trainer's libraries leave in ``/dev/shm`` when their processes end without
their own cleanup, and its removal around each attempt (``resume.run_attempts``).

Scope: one node, Linux ``/proc``; the names SGLang 0.5.14, loky, the CUDA driver and torch 2.11 give these files.
Seen on one H200 (2026-12-04, ``box_after.txt`` of ``tests/gpu/logs/2026-12-04-drill-*`` and ``-soak-cuda-ipc``):
every capture server start leaves ``sglang_loads_<instance>_<digest>.shm`` (16 KiB, SGLang's load snapshot: its
writer never unlinks it, even on a clean stop) and ``sem.loky-<pid>-<tag>`` (a named semaphore of the scheduler);
on cuda_ipc also ``cuda.shm.<device>.<pid, hex>.<n>`` (the CUDA driver's, for exported allocations) and
``torch_<pid>_<n>_<n>`` (torch's CUDA IPC reference counters). SGLang stops its scheduler with SIGKILL, so a run
that ends well leaves them too: ~180 KiB per server start, piling up in a RAM-backed filesystem over a run that
restarts for days.

Removed: regular files of this user with one of those names, modified at or after ``since``, whose creating
process (where the name carries its pid) is gone, and which no live process holds open or mapped
(``/proc/<pid>/fd``, ``/proc/<pid>/maps``). Any other name, other users' files, symlinks and files in use are
never touched; a file that vanishes meanwhile is skipped.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

#: name -> how its creating pid is written (None: the name carries none)
PATTERNS: tuple[tuple[re.Pattern[str], int | None], ...] = (
    (re.compile(r"sglang_loads_[A-Za-z0-9._-]+_[0-9a-f]{8}\.shm"), None),
    (re.compile(r"sem\.loky-(\d+)-[A-Za-z0-9_]+"), 10),
    (re.compile(r"cuda\.shm\.\d+\.([0-9a-f]+)\.\d+"), 16),
    (re.compile(r"torch_(\d+)_\d+_\d+"), 10),
)


def _creator(name: str) -> tuple[bool, int | None]:
    """(whether ``name`` is one of :data:`PATTERNS`, the pid it carries)."""
    for pattern, base in PATTERNS:
        m = pattern.fullmatch(name)
        if m:
            return True, int(m.group(1), base) if base else None
    return False, None


def _running(pid: int, proc: Path) -> bool:
    """Whether ``pid`` is a process that is not a zombie (a zombie holds no files)."""
    try:
        text = (proc / str(pid) / "stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    except OSError:
        return True  # there, unreadable: count it as running
    return text[text.rfind(")") + 2 :][:1] != "Z"


def held(shm: Path, proc: Path = Path("/proc")) -> set[str]:
    """Names under ``shm`` that a live, readable process holds open or mapped."""
    prefix = str(shm).rstrip("/") + "/"
    names: set[str] = set()
    try:
        pids = [p for p in os.listdir(proc) if p.isdigit()]
    except OSError:
        return names
    for pid in pids:
        try:
            for fd in os.listdir(proc / pid / "fd"):
                try:
                    target = os.readlink(proc / pid / "fd" / fd)
                except OSError:
                    continue
                if target.startswith(prefix):
                    names.add(target[len(prefix) :].removesuffix(" (deleted)"))
        except OSError:
            pass
        try:
            with open(proc / pid / "maps", errors="replace") as f:
                for line in f:
                    i = line.find(prefix)
                    if i >= 0:
                        names.add(line[i + len(prefix) :].rstrip("\n").removesuffix(" (deleted)"))
        except OSError:
            pass
    return names


def leftovers(since: float, shm: Path | None = None, proc: Path = Path("/proc")) -> list[str]:
    """The names :func:`remove_leftovers` would remove from ``shm`` (default: ``/dev/shm``) now."""
    shm = Path("/dev/shm") if shm is None else Path(shm)
    try:
        entries = sorted(os.listdir(shm))
    except OSError:
        return []
    uid = os.getuid()
    candidates = []
    for name in entries:
        known, pid = _creator(name)
        if not known or (pid is not None and _running(pid, proc)):
            continue
        try:
            st = os.lstat(shm / name)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode) and st.st_uid == uid and st.st_mtime >= since:
            candidates.append(name)
    if not candidates:
        return []
    busy = held(shm, proc)  # read after the listing: a file created since is not a candidate
    return [name for name in candidates if name not in busy]


def remove_leftovers(since: float, shm: Path | None = None, proc: Path = Path("/proc")) -> list[str]:
    """Remove the leftovers described above from ``shm`` (default: ``/dev/shm``); returns the names removed."""
    shm = Path("/dev/shm") if shm is None else Path(shm)
    removed = []
    for name in leftovers(since, shm, proc):
        try:
            os.unlink(shm / name)
        except OSError:  # gone meanwhile, or not ours to remove after all
            continue
        removed.append(name)
    return removed
