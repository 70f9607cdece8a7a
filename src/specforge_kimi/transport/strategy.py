"""One protocol every feature transport answers to, and the registry of them by name.

Scope: what a run plan asks of a transport -- whether it refuses a recipe and why, the GPU memory it adds, the
environment of each role, the SpecForge ``runtime:`` bytes it holds features in, the checks before a launch and in
``doctor``, and what it leaves behind to clean up. A strategy reads the recipe's sections as plain data and the
sizes the plan computed (:class:`FeatureSizing`); it imports nothing of the plan. :mod:`.registry` holds the
strategies by name; ``auto`` takes the first that accepts (``plan.transport_plan.choose``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

GIB = 1 << 30
#: the fraction of the store the producer's byte watermark may fill (the rest: the allocator's fragmentation)
WATERMARK_FRACTION = 0.8


@dataclass(frozen=True)
class FeatureSizing:
    """A recipe's features in flight, in bytes, as the plan sizes them (``plan.transport_plan.sizing``)."""

    sample_bytes: int  # one max_length sample's features (the family's captured layers + passthrough)
    window_samples: int  # samples the consumer takes before it acknowledges (one optimizer window)
    overshoot_samples: int  # what SpecForge's producer may have in flight past its watermark
    min_store_bytes: int  # one window plus the overshoot, at the watermark fraction
    pool_bytes: int  # a GPU pool's size (the recipe's, or sized from the memory plan)
    server_rows_bytes: int  # captured rows the scheduler keeps on the writer's GPU until the sink copied them
    prefetch_bytes: int  # a trainer rank's prefetched samples
    segment_bytes: int  # the Mooncake segment holding features in flight


@dataclass(frozen=True)
class Finding:
    """One ``doctor`` line a transport contributes: name, ``ok``/``warn``/``fail``, detail and fix."""

    name: str
    status: str
    detail: str
    fix: str = ""


class Transport(Protocol):
    """What a feature transport answers. ``r`` is a recipe (its sections read as data), ``s`` its sizing."""

    #: the name a recipe's ``server.transport`` gives, and the value of the role variables
    name: str
    #: whether a launch starts the Mooncake master for it
    runs_mooncake_master: bool
    #: the SGLang patch (by name) the capture server needs for it, or None
    sglang_patch: str | None

    def refusal(self, r, s: FeatureSizing) -> str | None:
        """Why this transport cannot serve the recipe (one line), or None."""

    def store_bytes(self, s: FeatureSizing) -> int:
        """The bytes it holds features in flight in (the producer's watermarks come from them)."""

    def memory_terms(self, s: FeatureSizing) -> dict[str, int]:
        """GPU bytes it adds: ``pool`` and ``server_rows`` on the writer's GPU, ``prefetch`` on every rank's."""

    def memory_report(self, s: FeatureSizing, writer_room_gib: float) -> dict[str, float]:
        """Its own entries of the memory plan (empty when it adds none)."""

    def server_env(self, r, s: FeatureSizing) -> dict[str, str]:
        """The capture server's variables for it."""

    def process_env(self, r) -> dict[str, str]:
        """The producer's and trainer ranks' variables for it."""

    def why_chosen(self, s: FeatureSizing) -> str | None:
        """Why a plan that may use it takes it, or None when it is only what remains."""

    def preflight(self, gpus: str, patch_gaps: list[str]) -> list[str]:
        """Problems of this host for it (one line each); ``patch_gaps``: what its :attr:`sglang_patch` lacks."""

    def doctor_findings(self, r, s: FeatureSizing, gpus: str, patch_gaps: list[str]) -> list[Finding]:
        """What ``doctor`` reports about it on this host."""

    def remove_stale(self, output_dir: str) -> list[str]:
        """What dead processes of a run left of it, removed; the paths."""


def store_refusal(setting: str, have: int, s: FeatureSizing) -> str | None:
    """Why a store of ``have`` bytes (named by the recipe's ``setting``) is too small for one optimizer window plus
    the producer's overshoot at the watermark, or None."""
    if have >= s.min_store_bytes:
        return None
    return (
        f"{setting} is below the {s.min_store_bytes / GIB:.2f} GiB one optimizer window ({s.window_samples} samples "
        f"of up to {s.sample_bytes / GIB:.3f} GiB) plus the producer's {s.overshoot_samples} in flight needs at a "
        f"{WATERMARK_FRACTION} watermark"
    )
