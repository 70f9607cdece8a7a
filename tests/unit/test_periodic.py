"""The background step shared by the GPU memory sampler and the live status line (``run.periodic``)."""

from __future__ import annotations

import time

from specforge_kimi.run.gpu_memory import GpuSampler, read_samples
from specforge_kimi.run.periodic import Periodic


def _until(cond, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.01)
    return cond()


def test_at_start_steps_at_once_and_leaving_stops_it():
    calls = []
    with Periodic(lambda: calls.append(1), 3600, name="t", at_start=True):
        assert _until(lambda: calls)
    assert calls == [1]


def test_without_at_start_the_first_step_waits_an_interval():
    calls = []
    with Periodic(lambda: calls.append(1), 3600, name="t"):
        time.sleep(0.2)
    assert calls == []


def test_the_step_repeats_every_interval():
    calls = []
    with Periodic(lambda: calls.append(1), 0.01, name="t"):
        assert _until(lambda: len(calls) >= 3)
    n = len(calls)
    time.sleep(0.1)
    assert len(calls) == n  # stopped


def test_the_gpu_sampler_samples_at_once(tmp_path):
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho '1, 512'\n")
    fake.chmod(0o755)
    out = tmp_path / "logs" / "gpu_mem_samples.csv"
    with GpuSampler(out, interval_s=3600, nvidia_smi=str(fake)):
        assert _until(out.exists)
    assert [r[1:3] for r in read_samples(out)] == [("1", 512)]
