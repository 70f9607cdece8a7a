"""What of a run is still alive on this node: the launcher's lock, and the processes that carry the run's mark.

Scope: one node, Linux ``/proc``. Every process ``launch`` starts carries ``SPECFORGE_KIMI_RUN_DIR=<output_dir>``
(absolute) in its environment, and every process those start inherits it: SGLang's schedulers, torchrun's
trainer ranks -- which run in sessions of their own, so a ``kill -9`` of the launch's process groups leaves
them behind, blocked on a Mooncake that is gone. The launcher itself holds ``<output_dir>/launch.lock``
(``flock``; the kernel drops it when the process dies, however it dies; opened ``O_NOFOLLOW``, mode ``0600``:
a ``launch.lock`` that is a link or not a regular file is refused with one line) and records who took it
(``launch.holder.json``: pid, start time, command line, role), so that ``stop`` signals that launcher and no
process that got its pid since nor another program holding the lock. ``launch --resume`` refuses while
the lock is held or marked processes live, and stops the marked processes when asked (``--stop-stale``:
SIGTERM, then SIGKILL after a grace period). Only the mark counts: a ``tail -f`` of a run log is not the
run's. Processes of other users cannot be read and are not seen.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

from specforge_kimi.durable import open_lock
from specforge_kimi.environment import RUN_DIR
from specforge_kimi.errors import KimiInputError
from specforge_kimi.procfs import stat_fields

RUN_DIR_ENV = RUN_DIR.name
LOCK_FILE = "launch.lock"
HOLDER_FILE = "launch.holder.json"
STOP_GRACE_S = 10.0

_HELD: dict[str, int] = {}  # output dir -> the lock's fd, kept open for this process's life


def acquire_lock(out: Path, *, role: str = "launch") -> None:
    """Hold ``out/launch.lock`` for the rest of this process (idempotent); refuse if another process holds it.
    Who took it is recorded in ``out/launch.holder.json`` (:func:`holder_problem` reads it): ``role`` is
    ``"launch"`` for a launcher, ``"stop"`` for ``specforge-kimi stop`` holding the run meanwhile."""
    import fcntl

    key = str(Path(out).resolve())
    if key in _HELD:
        return
    Path(out).mkdir(parents=True, exist_ok=True)
    path = Path(key) / LOCK_FILE
    fd = open_lock(path, what="launch lock")  # O_NOFOLLOW, 0600: a planted link is refused, never truncated
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise KimiInputError(
            f"another launch of {key} is running (pid {holder}, holding {path}); stop it first (kill {holder})"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    try:
        _record_holder(Path(key), role)
    except BaseException:
        os.close(fd)
        raise
    _HELD[key] = fd


def _cmdline(pid: int | str) -> list[str]:
    raw = _read(Path("/proc") / str(pid) / "cmdline")
    return [a.decode(errors="replace") for a in raw.split(b"\0")[:-1]] if raw else []


def _record_holder(out: Path, role: str) -> None:
    """Who holds the lock now: pid, start time (``/proc/<pid>/stat`` field 22), command line and role, so that
    ``stop`` can tell the launcher that took the lock from a process that later got its pid."""
    from specforge_kimi.durable import write_atomic

    fields = stat_fields(os.getpid())
    record = {
        "pid": os.getpid(),
        "start": fields[19] if len(fields) > 19 else None,
        "cmdline": _cmdline("self"),
        "role": role,
    }
    write_atomic(out / HOLDER_FILE, json.dumps(record) + "\n", mode=0o600)


def holder_problem(out: Path, pid: int) -> str | None:
    """Why process ``pid``, which holds ``out``'s lock, is not to be taken for the run's launcher (None: it is):
    the holder record must name it, as a launcher, with the start time and command line it has now -- a pid
    reused since, or a program that took the lock some other way, does not match."""
    try:
        record = json.loads((Path(out) / HOLDER_FILE).read_text())
        want = (int(record["pid"]), record["start"], list(record["cmdline"]), record["role"])
    except (OSError, ValueError, TypeError, KeyError):
        return f"no readable record of who took it ({HOLDER_FILE})"
    fields = stat_fields(pid)
    if want[0] != pid:
        return f"the record names pid {want[0]} as its holder, not pid {pid}"
    if want[3] != "launch":
        return f"pid {pid} took it as `{want[3]}`, not as a launcher"
    if want[1] is None or len(fields) <= 19 or fields[19] != want[1]:
        return f"pid {pid} is not the process that took it (another start time: a pid reused)"
    if _cmdline(pid) != want[2]:
        return f"pid {pid} runs another command line than the launcher that took it"
    return None


def lock_holder(out: Path, *, locks: Path = Path("/proc/locks")) -> int | None:
    """The pid holding ``out/launch.lock`` as the kernel reports it (``/proc/locks``, in this process's pid
    namespace), not as the file says: the file can name an earlier holder, or a pid since reused. None when the
    lock is free or its holder is not visible here."""
    try:
        st = os.stat(Path(out) / LOCK_FILE)
        lines = locks.read_text().splitlines()
    except OSError:
        return None
    want = (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)
    for line in lines:
        fields = line.split()
        if len(fields) < 6 or fields[1] != "FLOCK":  # "N: -> FLOCK ..." is a waiter, not a holder
            continue
        try:
            major, minor, inode = fields[5].split(":")
            if (int(major, 16), int(minor, 16), int(inode)) == want and int(fields[4]) > 0:
                return int(fields[4])
        except ValueError:
            continue
    return None


def release_lock(out: Path) -> None:
    fd = _HELD.pop(str(Path(out).resolve()), None)
    if fd is not None:
        os.close(fd)


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:
        return b""


def ancestors() -> set[int]:
    """This process and the processes it runs under: never to be stopped by it."""
    mine, pid = {os.getpid()}, os.getpid()
    while pid > 1:
        fields = stat_fields(pid)
        if len(fields) < 2 or not fields[1].isdigit():
            break
        pid = int(fields[1])
        mine.add(pid)
    return mine


def run_processes(out: Path) -> list[tuple[int, str]]:
    """``(pid, command line)`` of every live process that carries ``out``'s mark (this process and its
    ancestors excluded)."""
    key = str(Path(out).resolve())
    mark = f"{RUN_DIR_ENV}={key}".encode() + b"\0"
    mine = ancestors()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in mine:
            continue
        cmdline = _read(entry / "cmdline")
        if not cmdline:  # a kernel thread or a zombie: nothing to stop
            continue
        if b"\0" + mark in b"\0" + _read(entry / "environ") + b"\0":
            found.append((int(entry.name), cmdline.replace(b"\0", b" ").decode(errors="replace").strip()))
    return sorted(found)


def stop(processes: list[tuple[int, str]], *, grace_s: float = STOP_GRACE_S) -> list[int]:
    """SIGTERM each, SIGKILL what is left after ``grace_s``; returns the pids signalled. Raises if any
    survives SIGKILL for another ``grace_s`` (e.g. stuck in the kernel)."""
    pids = [pid for pid, _ in processes]

    def alive(pid: int) -> bool:
        fields = stat_fields(pid)
        return bool(fields) and fields[0] != "Z"

    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(alive(p) for p in pids):
            time.sleep(0.1)
        if not any(alive(p) for p in pids):
            return pids
    left = [p for p in pids if alive(p)]
    raise KimiInputError(f"processes {left} of the previous attempt survive SIGKILL; the node needs attention")
