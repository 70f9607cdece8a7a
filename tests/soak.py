"""Soak machinery (``tests/gpu/test_soak_gpu.py``): sample every process of a run while it trains, then say
whether each series stayed flat.

Sampled every ``interval_s`` against the consumer's optimizer step: host RSS (``VmRSS``) and open file
descriptors of every process carrying the run's mark (``run.run_guard``), GPU memory per process
(``nvidia-smi --query-compute-apps``), and the Mooncake master's ``master_allocated_bytes`` /
``master_key_count`` (its ``/metrics``).

Flat, stated: the first :data:`WARMUP_FRACTION` of the steps are warm-up (allocator pools, caches, the
first checkpoint) and not judged. The rest is split in thirds by step; a series' *rise* is the median of its
last third minus the median of its first third (medians: a swing of the samples in flight is not a trend; a
leak shows as a rise of about two thirds of what it added over the judged steps). Flat when the rise stays
within its bound (a fall is reported, not failed: memory given back is no leak):

- host RSS of a process: max(64 MiB, 5% of its median);
- GPU memory of a process: max(256 MiB, 2% of its median);
- open file descriptors of a process: 16;
- Mooncake allocated bytes: max(256 MiB, 50% of its median), key count: max(256, 50% of its median) (both
  swing with the samples in flight, bounded by the producer's watermarks; features never released grow
  without bound).

So a leak below ~1.5 x bound / steps judged per step (64 MiB over 4,000 steps: ~24 KiB of host memory a step)
is not seen by one soak; that is the resolution of this check, not a proof of none. The least-squares drift
over the judged samples is reported beside it.
"""

from __future__ import annotations

import re
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

WARMUP_FRACTION = 0.2
MIB = 1 << 20
BOUNDS = {  # series kind -> (absolute floor, fraction of the median)
    "rss_bytes": (64 * MIB, 0.05),
    "gpu_bytes": (256 * MIB, 0.02),
    "fds": (16, 0.0),
    "mooncake_allocated_bytes": (256 * MIB, 0.5),
    "mooncake_keys": (256, 0.5),
}


def role(cmdline: str) -> str:
    if "mooncake" in cmdline:
        return "mooncake-master"
    if "segment_keeper" in cmdline:
        return "segment-keeper"
    if "--role producer" in cmdline:
        return "producer"
    if "torch.distributed.run" in cmdline:
        return "torchrun"
    if "--role consumer" in cmdline:
        return "trainer-rank"
    if "capture_server" in cmdline or "reference_server" in cmdline or "sglang" in cmdline:
        return "capture-server"
    return "other"


def _status_rss(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _fds(pid: int) -> int | None:
    try:
        return len(list(Path(f"/proc/{pid}/fd").iterdir()))
    except OSError:
        return None


def _gpu_by_pid() -> dict[int, int]:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=20,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    found = {}
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit() and parts[1].isdigit():
            found[int(parts[0])] = int(parts[1]) * MIB
    return found


def _mooncake(metrics_url: str) -> dict[str, int]:
    try:
        text = urllib.request.urlopen(metrics_url, timeout=3).read().decode()
    except OSError:
        return {}
    got = {}
    for name, key in (("master_allocated_bytes", "mooncake_allocated_bytes"), ("master_key_count", "mooncake_keys")):
        m = re.search(rf"^{name} (\d+)", text, re.M)
        if m:
            got[key] = int(m.group(1))
    return got


class Sampler:
    """A thread sampling the run every ``interval_s`` until :meth:`stop`; ``step()`` gives the current step."""

    def __init__(self, out: Path, step, metrics_url: str, interval_s: float = 5.0):
        self.out, self.step, self.metrics_url, self.interval_s = out, step, metrics_url, interval_s
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def start(self) -> Sampler:
        self._thread.start()
        return self

    def stop(self) -> list[dict]:
        self._stop.set()
        self._thread.join(timeout=30)
        return self.samples

    def _loop(self) -> None:
        from specforge_kimi.run.run_guard import run_processes

        t0 = time.time()
        while not self._stop.is_set():
            procs = {}
            gpu = _gpu_by_pid()
            for pid, cmd in run_processes(self.out):
                rss, fds = _status_rss(pid), _fds(pid)
                if rss is None:
                    continue
                procs[f"{role(cmd)}:{pid}"] = {
                    "rss_bytes": rss,
                    "fds": fds,
                    **({"gpu_bytes": gpu[pid]} if pid in gpu else {}),
                }
            self.samples.append(
                {
                    "t": round(time.time() - t0, 2),
                    "step": self.step(),
                    "processes": procs,
                    **_mooncake(self.metrics_url),
                }
            )
            self._stop.wait(self.interval_s)


def series(samples: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """``{"<process>/<kind>" or "<kind>": [(step, value), ...]}`` from :class:`Sampler` samples."""
    out: dict[str, list[tuple[int, float]]] = {}
    for s in samples:
        if s.get("step") is None:
            continue
        for proc, values in s["processes"].items():
            for kind, v in values.items():
                if v is not None:
                    out.setdefault(f"{proc}/{kind}", []).append((s["step"], float(v)))
        for kind in ("mooncake_allocated_bytes", "mooncake_keys"):
            if kind in s:
                out.setdefault(kind, []).append((s["step"], float(s[kind])))
    return out


def drift(points: list[tuple[int, float]]) -> float:
    """Least-squares slope x the step range: how much the series rose (or fell) over the points."""
    n = len(points)
    if n < 3:
        return 0.0
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return 0.0
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    return slope * (max(xs) - min(xs))


def rise(points: list[tuple[int, float]]) -> float:
    """Median of the last third (by step) minus the median of the first third."""
    import statistics

    pts = sorted(points)
    third = max(1, len(pts) // 3)
    return statistics.median(v for _, v in pts[-third:]) - statistics.median(v for _, v in pts[:third])


def verdicts(samples: list[dict], total_steps: int) -> dict[str, dict]:
    """Per series: its rise after warm-up, the bound, flat or not (:data:`BOUNDS`); the drift beside it."""
    import statistics

    first = WARMUP_FRACTION * total_steps
    out = {}
    for name, points in series(samples).items():
        judged = [p for p in points if p[0] >= first]
        if len(judged) < 6:
            continue
        kind = name.rsplit("/", 1)[-1]
        floor, frac = BOUNDS[kind]
        median = statistics.median(v for _, v in judged)
        bound = max(floor, frac * median)
        r = rise(judged)
        out[name] = {
            "samples": len(judged),
            "median": median,
            "min": min(v for _, v in judged),
            "max": max(v for _, v in judged),
            "rise": r,
            "drift": drift(judged),
            "bound": bound,
            "flat": r <= bound,
        }
    return out


def plot(samples: list[dict], total_steps: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = series(samples)
    panels = [
        ("host RSS (MiB)", "rss_bytes", MIB),
        ("GPU memory (MiB)", "gpu_bytes", MIB),
        ("open fds", "fds", 1),
        ("Mooncake allocated (MiB) / keys", None, None),
    ]
    fig, axes = plt.subplots(2, 2, figsize=(13, 8), sharex=True)
    for ax, (title, kind, scale) in zip(axes.flat, panels, strict=True):
        if kind is None:
            for name, sc in (("mooncake_allocated_bytes", MIB), ("mooncake_keys", 1)):
                pts = data.get(name, [])
                ax.plot([p[0] for p in pts], [p[1] / sc for p in pts], label=name)
        else:
            for name, pts in sorted(data.items()):
                if name.endswith("/" + kind):
                    ax.plot([p[0] for p in pts], [p[1] / scale for p in pts], label=name.rsplit("/", 1)[0])
        ax.axvline(WARMUP_FRACTION * total_steps, color="grey", linestyle=":", linewidth=1)
        ax.set_title(title)
        ax.legend(fontsize=7)
    for ax in axes[1]:
        ax.set_xlabel("optimizer step")
    fig.suptitle("soak: tiny K2.5 TP=1 on one H200 (dotted: end of warm-up)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
