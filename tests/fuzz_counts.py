"""How many generated cases each fuzz surface tried, for the run's summary.

A property-based test calls ``record("prepare input lines")`` once per example it runs; the
``pytest_terminal_summary`` hook in ``tests/conftest.py`` prints one ``fuzz: <surface> N cases``
line per surface, so the counts show in plain ``pytest -q`` output. Import it as
``from fuzz_counts import record`` (``tests/`` is on ``sys.path`` through its conftest).
"""

from __future__ import annotations

import threading
from collections import Counter

_lock = threading.Lock()
_counts: Counter[str] = Counter()


def record(surface: str, n: int = 1) -> None:
    """Count ``n`` more cases tried on ``surface`` (a short human name, e.g. ``"regenerate replies"``)."""
    with _lock:
        _counts[surface] += n


def counts() -> dict[str, int]:
    """The counts so far, surface -> cases, in first-recorded order."""
    with _lock:
        return dict(_counts)
