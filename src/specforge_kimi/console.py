"""What the user's console shows: one progress bar per stage, plain lines when it is not a terminal,
and the stack's own chatter kept out of it.

Scope: the console of specforge-kimi's own commands (the demo, ``launch``, ``watch``). On a terminal a
stage is one tqdm bar sized to its real total; written to a file or a pipe it is a few plain lines
(the first update, one per quarter or per ``interval_s``, the end) and never a carriage return.
:func:`output_to_log` sends everything the process writes during a block -- Python prints, logging,
C libraries, other libraries' bars -- to a log file, while :func:`out` / :func:`err` keep writing to
the real console. :func:`quiet_known_notices` silences two import-time notices that say nothing about
a run (SpecForge's ``flash_attn is not found``: recipes and the demo choose the attention backend
themselves; torch's ``No CUDA runtime is found`` on a CPU host with ``CUDA_HOME`` set).
Light: imports nothing heavy (tqdm only when a bar is drawn on a terminal).
"""

from __future__ import annotations

import io
import logging
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

#: the notices :func:`quiet_known_notices` silences, and why they say nothing about a run
KNOWN_NOTICES = {
    "flash_attn is not found": "SpecForge's import-time notice; recipes and the demo pick the draft's attention "
    "backend themselves (flex_attention or sdpa), flash_attn is never used",
    "No CUDA runtime is found": "torch's notice on a CPU host whose CUDA_HOME is set; the CPU runs need no CUDA",
}


def _drop_no_cuda_runtime(record: logging.LogRecord) -> bool:
    return "No CUDA runtime is found" not in record.getMessage()


def quiet_known_notices() -> None:
    """Silence :data:`KNOWN_NOTICES` in this process (idempotent); everything else still shows."""
    warnings.filterwarnings("ignore", message=r"flash_attn is not found", category=UserWarning)
    cpp = logging.getLogger("torch.utils.cpp_extension")
    if _drop_no_cuda_runtime not in cpp.filters:
        cpp.addFilter(_drop_no_cuda_runtime)


@dataclass
class _Console:
    out: TextIO
    err: TextIO
    log: TextIO | None  # the log file of an active output_to_log


_consoles: list[_Console] = []


def _kept() -> list[TextIO]:
    return [s for c in _consoles for s in (c.out, c.err)]


def out() -> TextIO:
    """The console's stdout (the real one while :func:`output_to_log` sends stdout to a file)."""
    return _consoles[-1].out if _consoles else sys.stdout


def err() -> TextIO:
    """The console's stderr (the real one while :func:`output_to_log` sends stderr to a file)."""
    return _consoles[-1].err if _consoles else sys.stderr


def is_terminal(stream: TextIO | None = None) -> bool:
    """Whether ``stream`` (default: the console's stderr) is a terminal."""
    stream = err() if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def say(text: str) -> None:
    """One line to the console's stdout (and into the log an :func:`output_to_log` block is writing)."""
    print(text, file=out(), flush=True)
    if _consoles and _consoles[-1].log is not None:
        print(text, file=_consoles[-1].log, flush=True)


class _LineTap(io.TextIOBase):
    """A text stream that writes through to ``target`` and hands every complete line to ``on_line``."""

    def __init__(self, target: TextIO, on_line: Callable[[str], None] | None) -> None:
        self.target, self.on_line, self._part = target, on_line, ""

    def writable(self) -> bool:
        return True

    def write(self, s: str) -> int:
        self.target.write(s)
        if self.on_line is not None:
            *lines, self._part = (self._part + s).split("\n")
            for line in lines:
                self.on_line(line)
        return len(s)

    def flush(self) -> None:
        self.target.flush()

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return self.target.fileno()


def _console_stream(current: TextIO, fd: int, saved_fd: int) -> TextIO:
    """Where the console goes during a redirect: a new stream on the saved descriptor when ``current``
    writes to descriptor ``fd`` itself (it will point at the log), else ``current`` unchanged (a pytest
    capture, a StringIO: they never went through ``fd``)."""
    try:
        uses_fd = current.fileno() == fd
    except (AttributeError, OSError, ValueError):
        uses_fd = False
    if not uses_fd:
        return current
    return open(os.dup(saved_fd), "w", buffering=1, encoding="utf-8", errors="replace")  # noqa: SIM115


@contextmanager
def output_to_log(path: str | Path, *, on_line: Callable[[str], None] | None = None) -> Iterator[Path]:
    """Send what this process writes to stdout and stderr during the block to ``path`` (appended):
    Python's ``sys.stdout`` / ``sys.stderr``, and file descriptors 1 and 2, so logging handlers bound to
    the old streams, C libraries and child processes land there too. :func:`out`, :func:`err` and
    :func:`say` still reach the console. ``on_line`` gets every line printed to ``sys.stdout``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    for s in (sys.stdout, sys.stderr):
        try:
            s.flush()
        except (AttributeError, ValueError):
            pass
    saved = (os.dup(1), os.dup(2))
    log = open(path, "a", buffering=1, encoding="utf-8", errors="replace")  # noqa: SIM115
    if _consoles:  # nested: the outer block already keeps the console
        console = _Console(_consoles[-1].out, _consoles[-1].err, log)
    else:
        console = _Console(_console_stream(sys.stdout, 1, saved[0]), _console_stream(sys.stderr, 2, saved[1]), log)
    opened = [s for s in (console.out, console.err) if s not in (sys.stdout, sys.stderr, *_kept())]
    old = (sys.stdout, sys.stderr)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    sys.stdout, sys.stderr = _LineTap(log, on_line), _LineTap(log, None)
    _consoles.append(console)
    try:
        yield path
    finally:
        _consoles.remove(console)
        for s in (sys.stdout, sys.stderr, log):
            s.flush()
        sys.stdout, sys.stderr = old
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)
        for s in opened:
            s.close()
        log.close()


def _fmt_postfix(postfix: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in postfix.items())


def _fmt_s(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


class Progress:
    """One stage's progress: a tqdm bar on a terminal, a few plain lines otherwise, nothing when not
    ``enabled``. ``total`` is the stage's real total (``unit`` names it); :meth:`update` advances,
    ``postfix`` (e.g. ``loss="2.31"``) rides along."""

    def __init__(
        self,
        desc: str,
        total: float,
        *,
        unit: str = "it",
        enabled: bool = True,
        stream: TextIO | None = None,
        interval_s: float = 30.0,
    ) -> None:
        self.desc, self.total, self.unit, self.enabled = desc, total, unit, enabled
        self.stream = err() if stream is None else stream
        self.interval_s = interval_s
        self.n: float = 0
        self.postfix: dict = {}
        self._start = self._last_line = time.monotonic()
        self._next_quarter = 0.25
        self._lines = 0
        self._bar = None
        if enabled and is_terminal(self.stream):
            import shutil

            from tqdm import tqdm

            # the terminal's size, or 100 x 24 where it reports none (a pty without a size, where tqdm
            # would otherwise draw nothing)
            size = shutil.get_terminal_size((100, 24))
            self._bar = tqdm(
                total=total, desc=desc, unit=unit, file=self.stream, ncols=min(size.columns, 160), nrows=size.lines
            )

    def retotal(self, total: float) -> None:
        """The stage's total turned out to be ``total`` (e.g. a time budget allows fewer steps)."""
        if not self.enabled or total == self.total:
            return
        self.total = total
        if self._bar is not None:
            self._bar.total = total
            self._bar.refresh()

    def update(self, n: float = 1, **postfix) -> None:
        self.set(self.n + n, **postfix)

    def set(self, n: float, **postfix) -> None:
        """Progress is ``n`` of ``total`` now."""
        if not self.enabled:
            return
        n = min(n, self.total)
        self.postfix.update(postfix)
        if self._bar is not None:
            if postfix:
                self._bar.set_postfix_str(_fmt_postfix(self.postfix), refresh=False)
            if n != self.n:
                self._bar.update(n - self.n)  # redraws (at most every 0.1 s)
            elif postfix:
                self._bar.refresh()
            self.n = n
            return
        self.n = n
        frac = n / self.total if self.total else 1.0
        now = time.monotonic()
        if self._lines == 0 or frac >= self._next_quarter or now - self._last_line >= self.interval_s:
            while frac >= self._next_quarter:
                self._next_quarter += 0.25
            if frac < 1.0:
                self._line(f"{self._amount()}{self._extra()}, {_fmt_s(now - self._start)}")

    def _amount(self) -> str:
        n = int(self.n) if float(self.n).is_integer() else round(self.n, 1)
        total = int(self.total) if float(self.total).is_integer() else self.total
        return f"{n}/{total} {self.unit} ({self.n / self.total:.0%})" if self.total else f"{n} {self.unit}"

    def _extra(self) -> str:
        return f", {_fmt_postfix(self.postfix)}" if self.postfix else ""

    def _line(self, text: str) -> None:
        print(f"{self.desc}: {text}", file=self.stream, flush=True)
        self._lines += 1
        self._last_line = time.monotonic()

    def close(self, **postfix) -> None:
        """End the stage (its last line says where it stopped)."""
        if not self.enabled:
            return
        self.postfix.update(postfix)
        if self._bar is not None:
            if postfix:
                self._bar.set_postfix_str(_fmt_postfix(self.postfix), refresh=False)
            self._bar.close()
            self._bar = None
            return
        self._line(f"done, {self._amount()}{self._extra()}, {_fmt_s(time.monotonic() - self._start)}")
        self.enabled = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
