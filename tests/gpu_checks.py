"""Checks the GPU tests share: what an online run may leave on disk and on the GPUs (text only, CPU-testable)."""

from __future__ import annotations

#: bytes written per trained token besides checkpoints, export and rendered configs (refs, ledger, logs);
#: measured 64 on H200x2 (archive/gpu-runs/RUNS.md): features travel through the transport, not the disk
METADATA_BOUND = 256


def gpu_leftovers(text: str) -> tuple[list[str], list[str], int]:
    """Read the script's ``gpu_after.csv`` (``nvidia-smi --query-compute-apps=pid,used_memory`` then
    ``--query-gpu=index,memory.used``, each with its csv header): compute processes still listed, GPUs
    whose memory is not 0 MiB, and how many GPUs were listed -- for any number of GPUs."""
    apps, held, gpus, section = [], [], 0, None
    for line in (ln.strip() for ln in text.splitlines()):
        if line.startswith("pid"):
            section = "apps"
        elif line.startswith("index"):
            section = "gpus"
        elif line and section == "apps":
            apps.append(line)
        elif line and section == "gpus":
            gpus += 1
            if line.split(",")[1].strip() != "0 MiB":
                held.append(line)
    return apps, held, gpus
