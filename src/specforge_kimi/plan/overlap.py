"""The co-located stages' overlap model: one GPU that both prefills (the capture server) and trains (the draft).

Scope: arithmetic on rates in tokens per second -- nothing here measures or imports anything. Each stage alone has a
time per token (``1 / prefill``, ``1 / trainer``); taking turns on the GPU adds them (the *serial* rate); a co-located
run that hides part of the shorter stage's time behind the longer one beats that, at most by hiding all of it (the
*ceiling*). The *hidden fraction* is that part, 0 when the stages take turns and 1 when the shorter is wholly hidden,
below 0 when co-located is slower than taking turns; unlike ``rate / serial`` it does not depend on how the two
stages' times compare, so recipes and GPUs compare on it. ``tax_s`` is a per-token cost outside both stages (the
capture writer's), 0 where a rate already includes it.

One home for the formula that ``bench/overlap_rates.py`` (its rows), ``bench/sizing.py`` (its projection and the
hidden fraction it fits to measured runs) and ``bench/report.py`` (its tables) all use.
"""

from __future__ import annotations


def serial_rate(prefill: float, trainer: float) -> float:
    """Trained tok/s when the two stages take turns on the GPU: ``1 / (1/prefill + 1/trainer)``."""
    return 1.0 / (1.0 / prefill + 1.0 / trainer)


def ceiling_rate(prefill: float, trainer: float) -> float:
    """Trained tok/s with the shorter stage wholly hidden under the longer: ``min(prefill, trainer)``; over
    :func:`serial_rate` it is the highest co-located / serial a recipe can reach."""
    return min(prefill, trainer)


def gpu_s_per_token(prefill: float, trainer: float, hidden: float, tax_s: float = 0.0) -> float:
    """One GPU's seconds per token when it both prefills and trains with ``hidden`` of the shorter stage's time per
    token hidden behind the longer one, plus ``tax_s``."""
    a, b = 1.0 / prefill, 1.0 / trainer
    return a + b - hidden * min(a, b) + tax_s


def hidden_fraction(rate: float, prefill: float, trainer: float, tax_s: float = 0.0) -> float:
    """The hidden fraction at which :func:`gpu_s_per_token` is a measured co-located ``rate``'s time per token:
    ``(1/prefill + 1/trainer + tax_s - 1/rate) / min(1/prefill, 1/trainer)``."""
    a, b = 1.0 / prefill, 1.0 / trainer
    return (a + b + tax_s - 1.0 / rate) / min(a, b)
