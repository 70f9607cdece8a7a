"""The run's CUDA MPS daemon (recipe ``overlap.mps``): started before the node's services, stopped after them.

Scope: one ``nvidia-cuda-mps-control -d`` per node and attempt, with a pipe and a log directory private to the run
(mode 0700; the plan names them, ``plan.roles.mps_dirs``); every role carries the pipe directory in its environment
(``CUDA_MPS_PIPE_DIRECTORY``), so its CUDA contexts become clients of this daemon and of no other. The daemon is
stopped with ``echo quit | nvidia-cuda-mps-control`` however the attempt ends (a clean finish, a failed role,
Ctrl-C); a daemon a killed launcher left on the run's pipe is stopped by ``stop`` and before the next attempt's
start (:func:`stop_leftover`). A daemon that cannot start is a one-line :class:`KimiInputError` with its reason;
nothing else starts. The directories' parent is checked too (the /tmp fallback's name is predictable).
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from specforge_kimi.environment import CUDA_MPS_LOG_DIRECTORY, CUDA_MPS_PIPE_DIRECTORY, CUDA_VISIBLE_DEVICES
from specforge_kimi.errors import KimiInputError

CONTROL = "nvidia-cuda-mps-control"
#: the daemon's control socket in its pipe directory: there while a daemon serves that pipe
CONTROL_SOCKET = "control"
#: the start command's output, kept in the run's MPS log directory (a pipe would keep the start waiting on the
#: daemon's inherited descriptors)
START_OUTPUT = "start.out"
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 30.0


def private_dir(path: Path) -> Path:
    """``path`` made (parents too) and left mode 0700, owned by us and not a link; one-line error otherwise."""
    path.mkdir(parents=True, exist_ok=True)
    st = path.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():  # lstat: a link is no directory
        raise KimiInputError(f"CUDA MPS directory {path} is not a directory of ours; remove it or change output_dir")
    path.chmod(0o700)
    return path


def _env(pipe: str, log: str, gpus: str | None) -> dict[str, str]:
    env = {**os.environ, CUDA_MPS_PIPE_DIRECTORY.name: pipe, CUDA_MPS_LOG_DIRECTORY.name: log}
    if gpus is not None:
        env[CUDA_VISIBLE_DEVICES.name] = gpus
    return env


def _reason(proc: subprocess.CompletedProcess | None, log: Path, exc: BaseException | None = None) -> str:
    """Why the daemon did not start, in one line: the exception, its output, else its control.log's last line."""
    if exc is not None:
        return f"{type(exc).__name__}: {exc}"
    text = (log / START_OUTPUT).read_text(errors="replace").strip() if (log / START_OUTPUT).is_file() else ""
    if not text and (log / "control.log").is_file():
        text = (log / "control.log").read_text(errors="replace").strip()
    line = text.splitlines()[-1] if text else "no output"
    return f"exit code {proc.returncode if proc is not None else '?'}: {line}"


def start(pipe: str, log: str, gpus: str | None = None) -> None:
    """Start the daemon on ``pipe``/``log`` (made private first); :class:`KimiInputError` naming why it did not."""
    for d in {Path(pipe).parent, Path(log).parent, Path(pipe), Path(log)}:
        private_dir(d)
    if shutil.which(CONTROL) is None:
        raise KimiInputError(f"overlap.mps: {CONTROL} is not on PATH (CUDA MPS is not installed on this host)")
    stop_leftover((pipe, log))
    proc = exc = None
    try:
        with open(Path(log) / START_OUTPUT, "w", encoding="utf-8") as out:
            proc = subprocess.run(
                [CONTROL, "-d"],
                env=_env(pipe, log, gpus),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                timeout=START_TIMEOUT_S,
            )
    except (OSError, subprocess.TimeoutExpired) as e:
        exc = e
    if exc is not None or proc.returncode != 0:
        raise KimiInputError(f"overlap.mps: {CONTROL} -d did not start ({_reason(proc, Path(log), exc)})")


def stop(pipe: str, log: str) -> str | None:
    """``echo quit | nvidia-cuda-mps-control`` on the run's pipe; None when it answered, else why not."""
    try:
        proc = subprocess.run(
            [CONTROL], input="quit\n", env=_env(pipe, log, None), capture_output=True, text=True, timeout=STOP_TIMEOUT_S
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None if proc.returncode == 0 else _reason(proc, Path(log))


def stop_leftover(dirs: tuple[str, str] | None) -> str | None:
    """Stop a daemon still serving the run's pipe (its launcher was killed before its ``finally`` ran): ``quit``
    when the control socket is there; returns what was done, None when nothing was left."""
    if dirs is None or not (Path(dirs[0]) / CONTROL_SOCKET).exists():
        return None
    why = stop(*dirs)
    return "stopped a CUDA MPS daemon left on the run's pipe" if why is None else f"a left MPS daemon: {why}"


@contextmanager
def daemon(dirs: tuple[str, str] | None, gpus: str | None = None, say=print) -> Iterator[None]:
    """The run's MPS daemon around the block when ``dirs`` (the plan's ``mps_dirs``) is set; nothing otherwise."""
    if dirs is None:
        yield
        return
    pipe, log = dirs
    start(pipe, log, gpus)
    say(f"CUDA MPS daemon started (pipe {pipe}, log {log})")
    try:
        yield
    finally:
        why = stop(pipe, log)
        say("CUDA MPS daemon stopped" if why is None else f"CUDA MPS daemon did not stop cleanly: {why}")
