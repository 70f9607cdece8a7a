"""The ``allocator-retries`` seam: each optimizer step's caching-allocator retries in the step's metrics, and
``run-report``'s reading of them (``drafts.allocator_retries``, ``evaluate.run_report.perf``)."""

from __future__ import annotations

import pytest

from specforge_kimi.drafts import allocator_retries as ar
from specforge_kimi.evaluate.run_report import perf


class FakeCuda:
    """``torch.cuda``'s four calls the seam makes, with a retry counter the test moves."""

    def __init__(self, *, up: bool = True) -> None:
        self.up, self.retries, self.reserved = up, 0, 3 * ar.GIB

    def is_available(self) -> bool:
        return self.up

    def is_initialized(self) -> bool:
        return self.up

    def memory_stats(self) -> dict:
        return {"num_alloc_retries": self.retries}

    def memory_reserved(self) -> int:
        return self.reserved


class Core:
    pass


def test_each_optimizer_step_gets_the_retries_since_the_last_one():
    core, cuda = Core(), FakeCuda()
    cuda.retries = 2  # before the first step (the model's build): counted in the first
    assert ar.step_metrics(core, cuda) == {ar.RETRIES_KEY: 2.0, ar.RESERVED_KEY: 3.0}
    cuda.retries = 8
    assert ar.step_metrics(core, cuda)[ar.RETRIES_KEY] == 6.0
    assert ar.step_metrics(core, cuda)[ar.RETRIES_KEY] == 0.0
    assert ar.step_metrics(Core(), cuda)[ar.RETRIES_KEY] == 8.0  # per trainer, not per process


def test_nothing_without_an_initialised_cuda():
    assert ar.step_metrics(Core(), FakeCuda(up=False)) == {}
    import torch

    if not torch.cuda.is_available():  # this machine's own torch.cuda: the seam adds nothing on a CPU
        assert ar.step_metrics(Core(), torch.cuda) == {}


def test_the_wrapper_adds_them_to_stepped_results_only(monkeypatch):
    import torch
    from specforge.training.controller import StepResult, TrainerCore

    cuda = FakeCuda()
    monkeypatch.setattr(torch, "cuda", cuda)
    calls = []

    def stub(self, batch, ctx=None):
        calls.append(batch)
        return StepResult(optimizer_stepped=batch == "boundary", loss=1.0, grad_norm=None, metrics={"loss": 1.0})

    monkeypatch.setattr(TrainerCore, "train_step", stub)
    ar.install_allocator_retries()
    ar.install_allocator_retries()  # idempotent: one wrapper
    try:
        core = Core()
        cuda.retries = 5
        assert TrainerCore.train_step(core, "micro").metrics == {"loss": 1.0}  # no optimizer step: untouched
        got = TrainerCore.train_step(core, "boundary").metrics
        assert got == {"loss": 1.0, ar.RETRIES_KEY: 5.0, ar.RESERVED_KEY: 3.0}
        assert calls == ["micro", "boundary"]
    finally:
        ar.uninstall_allocator_retries()
    assert TrainerCore.train_step is stub


def _steps(n: int, **extra) -> list[dict]:
    return [
        {"step": i, "perf/optimizer_step_time_s": 0.3, "perf/train_compute_time_s": 0.29, **extra}
        for i in range(1, n + 1)
    ]


def test_run_report_names_the_median_retries_a_step():
    led = {"trained_tokens": 20 * 1536, "global_step": 20}
    out = perf(_steps(20, **{ar.RETRIES_KEY: 6.0, ar.RESERVED_KEY: 28.3}), led)
    assert out["allocator_retries_per_step"] == 6.0
    assert out["median"]["cuda_reserved_gib"] == pytest.approx(28.3)
    assert "allocator_retries_per_step" not in perf(_steps(20), led)  # a run from before the seam
