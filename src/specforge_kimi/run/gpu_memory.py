"""GPU memory per process while a launch runs, and the role each process plays.

Scope: ``nvidia-smi --query-compute-apps=pid,used_memory`` sampled every few seconds during
``specforge-kimi launch`` into ``<output_dir>/logs/gpu_mem_samples.csv`` -- one line per process and
sample, ``time,pid,used_mib,cmdline``, the format ``scripts/gpu_online_run.sh`` writes -- which
``run-report`` turns into per-role peaks and a plot. SpecForge records no GPU memory, so this is the
one thing a launch measures itself; without ``nvidia-smi`` (CPU hosts) nothing is sampled.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

from specforge_kimi.run.periodic import Periodic

SAMPLES_CSV = "gpu_mem_samples.csv"


#: the Mooncake master's role (its command line names it)
MASTER_ROLE = "mooncake"


def role_of(cmdline: str) -> str:
    """The launch role a process's command line belongs to (SGLang's workers name themselves ``sglang::...``)."""
    if "capture_server" in cmdline or "sglang" in cmdline:
        return "capture-server"
    if "--role consumer" in cmdline:
        return "trainer"
    if "--role producer" in cmdline:
        return "producer"
    if MASTER_ROLE in cmdline:  # the Mooncake master (a process name, not a transport)
        return MASTER_ROLE
    return "other"


def read_samples(path: Path) -> list[tuple[float, str, int, str]]:
    """``(time, pid, used_mib, cmdline)`` rows of a samples CSV (malformed lines skipped)."""
    rows = []
    for line in Path(path).read_text(errors="replace").splitlines():
        parts = line.split(",", 3)
        if len(parts) < 4 or not parts[2].strip().isdigit():
            continue
        try:
            t = float(parts[0])
        except ValueError:
            continue
        rows.append((t, parts[1].strip(), int(parts[2]), parts[3]))
    return rows


def _cmdline(pid: str) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return ""
    return raw.replace(b"\0", b" ").decode("utf-8", "replace").strip()[:160].replace(",", " ")


def sample_once(nvidia_smi: str = "nvidia-smi") -> list[str]:
    """One sample: a CSV line per compute process nvidia-smi lists (empty when it fails)."""
    try:
        res = subprocess.run(
            [nvidia_smi, "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    if res.returncode != 0:
        return []
    now = f"{time.time():.1f}"
    lines = []
    for row in res.stdout.splitlines():
        parts = [p.strip() for p in row.split(",")]
        if len(parts) >= 2 and parts[0].isdigit() and parts[1].isdigit():
            lines.append(f"{now},{parts[0]},{parts[1]},{_cmdline(parts[0])}")
    return lines


class GpuSampler:
    """Appends :func:`sample_once` to ``path`` every ``interval_s`` while the ``with`` block runs; does
    nothing when ``nvidia-smi`` is not on PATH."""

    def __init__(self, path: str | Path, *, interval_s: float = 5.0, nvidia_smi: str = "nvidia-smi") -> None:
        self.path = Path(path)
        self.interval_s = interval_s
        self.nvidia_smi = shutil.which(nvidia_smi)
        self._periodic: Periodic | None = None

    def _sample(self) -> None:
        lines = sample_once(self.nvidia_smi)
        if lines:
            with open(self.path, "a") as f:
                f.write("\n".join(lines) + "\n")

    def __enter__(self) -> GpuSampler:
        if self.nvidia_smi:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._periodic = Periodic(
                self._sample, self.interval_s, name="specforge-kimi-gpu-samples", at_start=True
            ).start()
        return self

    def __exit__(self, *exc) -> None:
        if self._periodic is not None:
            self._periodic.stop()
