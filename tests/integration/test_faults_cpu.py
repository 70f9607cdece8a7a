"""Fault drills on the co-located online loop, on CPU (real Mooncake, SpecForge's producer,
torchrun consumer and supervisor; the CPU reference capture server in SGLang's place).

Without ``resilience`` settings (the default recipe), each drill kills one role after the
consumer logged a few optimizer steps: the run must stop with a non-zero status within
``STOP_BOUND_S`` of the kill (never hang), leave no process behind, and leave SpecForge's ledger
consistent (no duplicate, none acknowledged without a committed ref, durable marker = acked
samples for batch 1 on one rank).

With ``resilience`` (segment keeper + server keeper; consumer keeper), the run recovers: a killed
capture server is restarted while the producer waits and the committed features wait in the
keeper's segment; a trainer rank that crashes at a checkpointed step is resumed consumer-only
from that checkpoint (SpecForge's own online resume). Either way every prompt is trained exactly
once -- checked against SpecForge's ledger. A Mooncake master restart is not recoverable (every
client's segment registration lives in it): the drill checks the clean, bounded stop.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from drills import (
    KILL_AFTER_STEP,
    check_recovered,
    check_stopped,
    drill,
    inject_consumer_crash,
    kill_server_child,
    kill_service,
    kill_trainer_rank,
    producer_just_ahead,
    record,
)
from online_cpu import cpu_plan

pytestmark = pytest.mark.slow


def _build(
    tmp_path: Path, save_interval: int = 2, resilience: dict | None = None, dp: int = 1, transport: str = "mooncake"
):
    def build():
        plan, recipe, _rendered, _target = cpu_plan(
            tmp_path, steps=200, save_interval=save_interval, resilience=resilience, dp=dp, transport=transport
        )
        return plan, recipe, tmp_path / "data" / "prompts.jsonl"

    return build


def test_capture_server_killed(tmp_path):
    res = drill(tmp_path, kill_service("reference_server"), _build(tmp_path))
    record("capture server SIGKILL", res)
    check_stopped(res)


def test_trainer_rank_killed(tmp_path):
    res = drill(tmp_path, kill_trainer_rank, _build(tmp_path))
    record("trainer rank SIGKILL", res)
    check_stopped(res)
    # the last checkpoint is whole: SpecForge can load it (resume / export input)
    from specforge.export.checkpoint_io import resolve_training_state

    ckpts = res["report"]["checkpoints"]
    assert ckpts, "no checkpoint before the kill"
    state = resolve_training_state(str(res["out"] / ckpts[-1]))
    assert state["global_step"] == int(ckpts[-1].rsplit("step", 1)[1]) and "draft_state_dict" in state


def test_mooncake_master_killed(tmp_path):
    res = drill(tmp_path, kill_service("mooncake.cli"), _build(tmp_path))
    record("mooncake master SIGKILL", res)
    check_stopped(res)


def test_capture_server_lost_and_restarted(tmp_path):
    res = drill(
        tmp_path,
        kill_server_child(),
        _build(tmp_path, resilience={"segment_owner": "keeper", "server_restarts": 2}),
        edit_plan=producer_just_ahead,
    )
    record("capture server SIGKILL, segment keeper + server keeper", res)
    check_recovered(res)
    logs = res["out"] / "logs"
    assert "restart 1/2" in (logs / "capture-server-node0.log").read_text()
    assert "unreachable" in (logs / "producer.log").read_text()


@pytest.mark.parametrize("dp", [1, 2])
def test_trainer_crash_resumed_from_checkpoint(tmp_path, dp):
    """With 2 ranks one crashes and torchrun stops the other: neither may end the producer."""
    res = drill(
        tmp_path,
        lambda _spawned: ["fault_consumer"],
        _build(tmp_path, save_interval=1, resilience={"consumer_restarts": 1}, dp=dp),
        edit_plan=inject_consumer_crash,
    )
    record(f"trainer rank crash at a checkpoint, consumer keeper, {dp} rank(s)", res)
    assert (tmp_path / "crashed").is_file(), "the injected crash did not happen"
    check_recovered(res, dp=dp)
    log = (res["out"] / "logs" / "consumer-node0.log").read_text()
    resumed = log.index(f"resuming from step {KILL_AFTER_STEP}")
    # the loss curve continues where the checkpoint left off: the next logged step is 4, after the resume
    assert re.search(rf"^step {KILL_AFTER_STEP + 1}:", log[resumed:], re.M)
    assert not re.search(rf"^step {KILL_AFTER_STEP}:", log[resumed:], re.M)


# -- the cuda_ipc transport (recipe server.transport: cuda_ipc; the reference server's shared-memory pool) ---------
def _pool_files(out: Path) -> list[Path]:
    """The pool files under the run's ipc dir and their slot tables / shared-memory files in /dev/shm."""
    import json

    found = []
    for f in (out / "ipc").glob("*.json"):
        info = json.loads(f.read_text())
        found += [f, *(Path(p) for p in (info["slots_path"], info["handle"].get("path")) if p and Path(p).exists())]
    return found


def test_cuda_ipc_capture_server_killed(tmp_path):
    """The server dies with its pool while slots are lent to the trainer: a clean, bounded stop; what its
    SIGKILL left (pool file, slot table, shared-memory pool) is what ``launch`` removes at the end."""
    from specforge_kimi.transport.pool import remove_stale

    res = drill(tmp_path, kill_service("reference_server"), _build(tmp_path, transport="cuda_ipc"))
    record("cuda_ipc: capture server SIGKILL with slots lent", res)
    check_stopped(res)
    left = _pool_files(res["out"])
    assert len(left) == 3, left  # SIGKILL: no cleanup ran
    assert len(remove_stale(res["out"] / "ipc")) == 1 and not any(p.exists() for p in left)


def test_cuda_ipc_trainer_crash_replays_from_the_pool(tmp_path):
    """A trainer rank SIGKILLed (right after its step-3 checkpoint) while it holds mapped, unacknowledged slots:
    the consumer keeper resumes it and it reads those samples again from the server's pool (they were released
    only at acknowledged optimizer steps); every prompt trained exactly once, no slot reaches its lease."""
    res = drill(
        tmp_path,
        lambda _spawned: ["fault_consumer"],
        _build(tmp_path, save_interval=1, resilience={"consumer_restarts": 1}, transport="cuda_ipc"),
        edit_plan=inject_consumer_crash,
    )
    record("cuda_ipc: trainer rank crash at a checkpoint with mapped slots, consumer keeper", res)
    assert (tmp_path / "crashed").is_file(), "the injected crash did not happen"
    check_recovered(res)
    server = (res["out"] / "logs" / "capture-server-node0.log").read_text()
    closed = re.findall(r"cuda_ipc pool \w+ closed: (\{.*\})$", server, flags=re.MULTILINE)  # the writer's counters
    assert len(closed) == 1 and json.loads(closed[0])["expired"] == 0, server[-2000:]
    assert "past the" not in server, server[-2000:]
    assert not _pool_files(res["out"])  # the server's clean stop removed its files
