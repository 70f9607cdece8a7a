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

import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from online_cpu import cpu_plan

pytestmark = pytest.mark.slow

STOP_BOUND_S = 60.0  # kill -> run_plan returned: SpecForge's supervisor polls children every 50 ms,
# then SIGTERM with a 30 s grace before SIGKILL (launch.build_colocated_plan's shutdown_grace_s)
KILL_AFTER_STEP = 3


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _pids_matching(text: str) -> list[int]:
    return [int(d.name) for d in Path("/proc").iterdir() if d.name.isdigit() and text in _cmdline(int(d.name))
            and int(d.name) != os.getpid()]


def _drill(tmp_path: Path, victim, *, save_interval: int = 2, resilience: dict | None = None, edit_plan=None) -> dict:
    from specforge_kimi.launch import run_plan
    from specforge_kimi.run_report import report

    plan, recipe, _rendered, _target = cpu_plan(tmp_path, steps=200, save_interval=save_interval,
                                                resilience=resilience)
    if edit_plan is not None:
        plan = edit_plan(plan, tmp_path)
    out = Path(recipe.output_dir)
    log = out / "logs" / "consumer-node0.log"
    spawned: list[subprocess.Popen] = []
    state: dict = {}

    def popen(*a, **k):
        p = subprocess.Popen(*a, **k)
        spawned.append(p)
        return p

    def watch():
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            if log.is_file() and re.search(rf"^step {KILL_AFTER_STEP}:", log.read_text(errors="replace"), re.M):
                state["victims"] = victim(spawned)
                state["killed_at"] = time.monotonic()
                return
            time.sleep(0.1)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    rc = run_plan(plan, managed_preflight=lambda _p: None, popen=popen)
    returned = time.monotonic()
    thread.join(timeout=5)
    time.sleep(0.5)
    prompts = len((tmp_path / "data" / "prompts.jsonl").read_text().splitlines())
    return {"rc": rc, "prompts": prompts, "stop_s": returned - state["killed_at"] if "killed_at" in state else None,
            "victims": state.get("victims"), "left": _pids_matching(str(out)) + _pids_matching(str(recipe.target.path)),
            "spawned_alive": [p.pid for p in spawned if p.poll() is None], "report": report(out), "out": out}


def _kill_service(label: str):
    def kill(spawned):
        victims = [p.pid for p in spawned if label in " ".join(map(str, p.args))]
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        return victims
    return kill


def _kill_trainer_rank(_spawned):
    ranks = [pid for pid in _pids_matching("--role consumer") if "torch.distributed.run" not in _cmdline(pid)
             and "/bin/sh" not in _cmdline(pid)]
    for pid in ranks:
        os.kill(pid, signal.SIGKILL)
    return ranks


def _record(name: str, res: dict) -> None:
    """Append the drill's outcome to ``$SPECFORGE_KIMI_DRILL_OUT`` (JSON lines) when set."""
    target = os.environ.get("SPECFORGE_KIMI_DRILL_OUT")
    if target:
        import json

        led = res["report"]["ledger"]
        with open(target, "a") as f:
            f.write(json.dumps({"drill": name, "rc": res["rc"], "stop_s": res["stop_s"], "victims": res["victims"],
                                "processes_left": len(res["left"]) + len(res["spawned_alive"]),
                                "acked": led["acked"], "duplicates": led["duplicates"],
                                "global_step": led["global_step"], "committed": led["committed"],
                                "checkpoints": res["report"]["checkpoints"]}) + "\n")


def _check(res: dict) -> None:
    assert res["victims"], "the drill never reached its kill point"
    assert res["rc"] != 0
    assert res["stop_s"] is not None and res["stop_s"] < STOP_BOUND_S, res["stop_s"]
    assert not res["left"] and not res["spawned_alive"], (res["left"], res["spawned_alive"])
    led = res["report"]["ledger"]
    assert led["duplicates"] == 0 and led["acked_not_committed"] == 0
    assert led["acked"] == led["acked_unique"] == led["global_step"] >= KILL_AFTER_STEP


def test_capture_server_killed(tmp_path):
    res = _drill(tmp_path, _kill_service("reference_server"))
    _record("capture server SIGKILL", res)
    _check(res)


def test_trainer_rank_killed(tmp_path):
    res = _drill(tmp_path, _kill_trainer_rank)
    _record("trainer rank SIGKILL", res)
    _check(res)
    # the last checkpoint is whole: SpecForge can load it (resume / export input)
    from specforge.export.checkpoint_io import resolve_training_state

    ckpts = res["report"]["checkpoints"]
    assert ckpts, "no checkpoint before the kill"
    state = resolve_training_state(str(res["out"] / ckpts[-1]))
    assert state["global_step"] == int(ckpts[-1].rsplit("step", 1)[1]) and "draft_state_dict" in state


def test_mooncake_master_killed(tmp_path):
    res = _drill(tmp_path, _kill_service("mooncake.cli"))
    _record("mooncake master SIGKILL", res)
    _check(res)


def _kill_server_child(_spawned):
    pids = [pid for pid in _pids_matching("specforge_kimi.reference_server")
            if "specforge_kimi.keeper" not in _cmdline(pid)]
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    return pids


def _check_recovered(res: dict) -> None:
    assert res["victims"], "the drill never reached its kill point"
    assert res["rc"] == 0, (res["out"] / "logs" / "consumer-node0.log").read_text()[-3000:]
    assert not res["left"] and not res["spawned_alive"], (res["left"], res["spawned_alive"])
    led = res["report"]["ledger"]
    # every prompt trained exactly once: nothing lost, nothing duplicated
    assert led["duplicates"] == 0 and led["acked_not_committed"] == 0
    assert led["acked"] == led["acked_unique"] == led["committed"] == res["prompts"] == led["global_step"]


def _producer_just_ahead(plan, _tmp_path: Path):
    """Producer keeps at most 4 refs in flight, so it is still capturing when the server dies."""
    import dataclasses

    producer, consumer = plan.commands
    env = {**producer.env, "DISAGG_IN_FLIGHT_HIGH_WATERMARK": "4", "DISAGG_IN_FLIGHT_LOW_WATERMARK": "2"}
    return dataclasses.replace(plan, commands=(dataclasses.replace(producer, env=env), consumer))


def test_capture_server_lost_and_restarted(tmp_path):
    res = _drill(tmp_path, _kill_server_child, resilience={"segment_owner": "keeper", "server_restarts": 2},
                 edit_plan=_producer_just_ahead)
    _record("capture server SIGKILL, segment keeper + server keeper", res)
    _check_recovered(res)
    logs = res["out"] / "logs"
    assert "restart 1/2" in (logs / "capture-server-node0.log").read_text()
    assert "unreachable" in (logs / "producer.log").read_text()


def _inject_consumer_crash(plan, tmp_path: Path):
    """Consumer ranks run ``fault_consumer`` (SIGKILL right after the step-3 checkpoint, once)."""
    import dataclasses

    producer, consumer = plan.commands
    argv = list(consumer.argv)
    i = argv.index("torch.distributed.run")
    j = argv.index("specforge_kimi", i)
    argv[j] = "fault_consumer"
    env = {**consumer.env, "FAULT_AFTER_SAVE_STEP": str(KILL_AFTER_STEP), "FAULT_MARKER": str(tmp_path / "crashed"),
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    return dataclasses.replace(plan, commands=(producer, dataclasses.replace(consumer, argv=tuple(argv), env=env)))


def test_trainer_crash_resumed_from_checkpoint(tmp_path):
    res = _drill(tmp_path, lambda _spawned: ["fault_consumer"], save_interval=1,
                 resilience={"consumer_restarts": 1}, edit_plan=_inject_consumer_crash)
    _record("trainer rank crash at a checkpoint, consumer keeper", res)
    assert (tmp_path / "crashed").is_file(), "the injected crash did not happen"
    _check_recovered(res)
    log = (res["out"] / "logs" / "consumer-node0.log").read_text()
    resumed = log.index(f"resuming from step {KILL_AFTER_STEP}")
    # the loss curve continues where the checkpoint left off: the next logged step is 4, after the resume
    assert re.search(rf"^step {KILL_AFTER_STEP + 1}:", log[resumed:], re.M)
    assert not re.search(rf"^step {KILL_AFTER_STEP}:", log[resumed:], re.M)
