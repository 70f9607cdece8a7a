"""A call repeated on a background thread while a launch runs: the GPU memory sampler (:mod:`gpu_memory`) and the
live status line (:mod:`progress`) each hand it their one step.

Scope: one daemon thread per ``with`` block, woken by a timer; a step that raises ends the thread (a caller whose
step must never stop catches inside it). Leaving the block stops the timer and waits for the step in flight.
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class Periodic:
    """``step()`` on a daemon thread named ``name`` every ``interval_s`` seconds while the ``with`` block runs: the
    first call at once with ``at_start``, otherwise after the first interval. Leaving the block waits for the thread
    (at most 30 s)."""

    def __init__(self, step: Callable[[], object], interval_s: float, *, name: str, at_start: bool = False) -> None:
        self.step, self.interval_s, self.name, self.at_start = step, interval_s, name, at_start
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _loop(self) -> None:
        if self.at_start:
            self.step()
        while not self._stop.wait(self.interval_s):
            self.step()

    def start(self) -> Periodic:
        """Start the thread (what entering the ``with`` block does)."""
        self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the timer and wait for the step in flight (what leaving the ``with`` block does)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def __enter__(self) -> Periodic:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
