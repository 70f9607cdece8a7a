"""What the capture server's and the trainer's libraries leave in ``/dev/shm`` when their processes end without
their own cleanup, and its removal around each attempt (``resume.run_attempts``).

Scope: one node, Linux ``/proc``; the names SGLang 0.5.14, loky, the CUDA driver and torch 2.11 give these files.
Seen on a GPU node after the fault and resume drills and the cuda_ipc soak (``box_after.txt`` of their logs under
``archive/gpu-runs/logs``; archive/gpu-runs/RUNS.md, "What box_after.txt showed"): every capture server start leaves
``sglang_loads_<instance>_<digest>.shm`` (SGLang's load snapshot: its writer never unlinks it, even on a clean stop)
and ``sem.loky-<pid>-<tag>`` (a named semaphore of the scheduler);
on cuda_ipc also ``cuda.shm.<device>.<pid, hex>.<n>`` (the CUDA driver's, for exported allocations) and
``torch_<pid>_<n>_<n>`` (torch's CUDA IPC reference counters). SGLang stops its scheduler with SIGKILL, so a run
that ends well leaves them too, a few per server start, piling up in a RAM-backed filesystem over a run that
restarts for days.

Removed: regular files of this user with one of those names, modified at or after ``since``, whose creating
process (where the name carries its pid) is gone, and which no live process holds open or mapped
(``/proc/<pid>/fd``, ``/proc/<pid>/maps``, compared by inode). The names carry no run, so another run of the same
user on the node loses such files of its dead processes too (garbage to it as well). Any other name, other users'
files (even for root, whom ``/dev/shm``'s sticky bit does not stop), symlinks and files in use are never touched:
each file is looked at again just before it is unlinked, and one replaced meanwhile (another inode, owner or kind)
stays; a file that vanishes meanwhile is skipped.
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
    (re.compile(r"cuda\.shm\.[0-9a-f]+\.([0-9a-f]+)\.[0-9a-f]+"), 16),
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
    """Whether ``pid`` runs. A zombie holds no files -- unless only its main thread exited and other threads of
    it still run (``/proc/<pid>/task`` lists them)."""
    from specforge_kimi.procfs import stat_fields

    fields = stat_fields(pid, proc)
    if not fields:
        return (proc / str(pid)).exists()  # gone; or there but unreadable: count it as running
    if fields[0] != "Z":
        return True
    try:
        return len(os.listdir(proc / str(pid) / "task")) > 1
    except OSError:
        return False


def held(proc: Path = Path("/proc")) -> set[tuple[int, int]]:
    """``(st_dev, st_ino)`` of every file a live, readable process holds open (``fd``) or mapped (``maps``): by
    inode, not by path, so another mount of the same tmpfs, a symlinked ``/dev/shm`` or a name with spaces does not
    hide a file in use."""
    found: set[tuple[int, int]] = set()
    try:
        pids = [p for p in os.listdir(proc) if p.isdigit()]
    except OSError:
        return found
    for pid in pids:
        fd_dir = proc / pid / "fd"
        try:
            fds = os.listdir(fd_dir)
        except OSError:
            fds = []
        for fd in fds:
            try:
                st = os.stat(fd_dir / fd)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                found.add((st.st_dev, st.st_ino))
        try:
            with open(proc / pid / "maps", errors="replace") as f:
                for line in f:
                    fields = line.split(maxsplit=5)  # address perms offset dev inode [path]
                    if len(fields) < 5 or fields[4] == "0":
                        continue
                    major, _, minor = fields[3].partition(":")
                    try:
                        found.add((os.makedev(int(major, 16), int(minor, 16)), int(fields[4])))
                    except ValueError:
                        continue
        except OSError:
            pass
    return found


def own_files(shm: Path | None = None) -> dict[str, os.stat_result]:
    """``{name: lstat}`` of this user's regular files in ``shm`` (default: ``/dev/shm``), whatever their names; a file
    that vanishes meanwhile is skipped."""
    shm = Path("/dev/shm") if shm is None else Path(shm)
    try:
        entries = sorted(os.listdir(shm))
    except OSError:
        return {}
    uid = os.geteuid()  # the owner of the files this user's processes create
    found = {}
    for name in entries:
        try:
            st = os.lstat(shm / name)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode) and st.st_uid == uid:
            found[name] = st
    return found


def matching(since: float, shm: Path | None = None) -> dict[str, tuple[int, int]]:
    """``{name: (st_dev, st_ino)}`` of this user's regular files in ``shm`` (default: ``/dev/shm``) with one of
    :data:`PATTERNS`' names, modified at or after ``since``, whoever holds them: what the drills require to be gone."""
    return {
        name: (st.st_dev, st.st_ino)
        for name, st in own_files(shm).items()
        if _creator(name)[0] and st.st_mtime >= since
    }


def leftovers(since: float, shm: Path | None = None, proc: Path = Path("/proc")) -> list[str]:
    """The names :func:`remove_leftovers` would remove from ``shm`` (default: ``/dev/shm``) now: :func:`matching`'s
    whose creator (where named) is gone and which no live process holds."""
    return list(_leftovers(since, shm, proc))


def _leftovers(since: float, shm: Path | None, proc: Path) -> dict[str, tuple[int, int]]:
    candidates = {n: key for n, key in matching(since, shm).items() if not _running_creator(n, proc)}
    if not candidates:
        return {}
    busy = held(proc)  # read after the listing: a file created since is not a candidate
    return {name: key for name, key in candidates.items() if key not in busy}


def _running_creator(name: str, proc: Path) -> bool:
    pid = _creator(name)[1]
    return pid is not None and _running(pid, proc)


def remove_leftovers(since: float, shm: Path | None = None, proc: Path = Path("/proc")) -> list[str]:
    """Remove the leftovers described above from ``shm`` (default: ``/dev/shm``); returns the names removed."""
    shm = Path("/dev/shm") if shm is None else Path(shm)
    removed = []
    for name, key in _leftovers(since, shm, proc).items():
        try:
            st = os.lstat(shm / name)
            if (st.st_dev, st.st_ino) != key or not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                continue  # replaced since it was listed: not the file found to be garbage
            os.unlink(shm / name)
        except OSError:  # gone meanwhile, or not ours to remove after all
            continue
        removed.append(name)
    return removed
