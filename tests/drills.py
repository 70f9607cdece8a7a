"""Fault-drill machinery shared by the CPU drills (``tests/integration/test_faults_cpu.py``) and the
GPU drills (``tests/gpu/test_faults_gpu.py``): run a co-located plan under SpecForge's supervisor,
kill a role once the consumer logged step ``KILL_AFTER_STEP``, and read the outcome back from
SpecForge's ledger."""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

from specforge_kimi.procfs import stat_fields

STOP_BOUND_S = 60.0  # kill -> run_plan returned: SpecForge's supervisor polls children every 50 ms,
# then SIGTERM with a 30 s grace before SIGKILL (launch.build_colocated_plan's shutdown_grace_s)
KILL_AFTER_STEP = 3
INTEGRATION = Path(__file__).resolve().parent / "integration"


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def pids_matching(text: str) -> list[int]:
    return [
        int(d.name)
        for d in Path("/proc").iterdir()
        if d.name.isdigit() and text in cmdline(int(d.name)) and int(d.name) != os.getpid()
    ]


def drill(tmp_path: Path, victim, build, *, edit_plan=None, wait_s: float = 240) -> dict:
    """``build()`` -> ``(plan, recipe, prompts_path)``; kill with ``victim(spawned)``; the outcome."""
    from specforge_kimi.evaluate.run_report import report
    from specforge_kimi.run.launch import run_plan

    plan, recipe, prompts_path = build()
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
        deadline = time.monotonic() + wait_s
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
    prompts = len(Path(prompts_path).read_text().splitlines())
    return {
        "rc": rc,
        "prompts": prompts,
        "stop_s": returned - state["killed_at"] if "killed_at" in state else None,
        "victims": state.get("victims"),
        "left": pids_matching(str(out)) + pids_matching(str(recipe.target.path)),
        "spawned_alive": [p.pid for p in spawned if p.poll() is None],
        "report": report(out),
        "out": out,
        "recipe": recipe,
    }


def kill_service(label: str):
    def kill(spawned):
        victims = [p.pid for p in spawned if label in " ".join(map(str, p.args))]
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        return victims

    return kill


def kill_trainer_rank(_spawned):
    ranks = [
        pid
        for pid in pids_matching("--role consumer")
        if "torch.distributed.run" not in cmdline(pid) and "/bin/sh" not in cmdline(pid)
    ]
    for pid in ranks:
        os.kill(pid, signal.SIGKILL)
    return ranks


def record(name: str, res: dict) -> None:
    """Append the drill's outcome to ``$SPECFORGE_KIMI_DRILL_OUT`` (JSON lines) when set."""
    target = os.environ.get("SPECFORGE_KIMI_DRILL_OUT")
    if target:
        import json

        led = res["report"]["ledger"]
        with open(target, "a") as f:
            f.write(
                json.dumps(
                    {
                        "drill": name,
                        "rc": res["rc"],
                        "stop_s": res["stop_s"],
                        "victims": res["victims"],
                        "processes_left": len(res["left"]) + len(res["spawned_alive"]),
                        "acked": led["acked"],
                        "duplicates": led["duplicates"],
                        "global_step": led["global_step"],
                        "committed": led["committed"],
                        "checkpoints": res["report"]["checkpoints"],
                    }
                )
                + "\n"
            )


def check_stopped(res: dict, dp: int = 1) -> None:
    assert res["victims"], "the drill never reached its kill point"
    assert res["rc"] != 0
    assert res["stop_s"] is not None and res["stop_s"] < STOP_BOUND_S, res["stop_s"]
    assert not res["left"] and not res["spawned_alive"], (res["left"], res["spawned_alive"])
    led = res["report"]["ledger"]
    assert led["duplicates"] == 0 and led["acked_not_committed"] == 0
    assert led["acked"] == led["acked_unique"] == led["global_step"] * dp >= KILL_AFTER_STEP * dp


def descendants(pid: int) -> list[int]:
    """``pid``'s children, grandchildren, ... (from /proc)."""
    parents: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        fields = stat_fields(int(d.name)) if d.name.isdigit() else []
        if len(fields) > 1:
            parents.setdefault(int(fields[1]), []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def kill_server_child(module: str = "specforge_kimi.servers.reference_server"):
    """SIGKILL the capture server a keeper runs (and its workers: SGLang's schedulers), not the keeper."""

    def kill(_spawned):
        roots = [pid for pid in pids_matching(module) if "specforge_kimi.run.keeper" not in cmdline(pid)]
        victims = [p for root in roots for p in (root, *descendants(root))]
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return victims

    return kill


def check_recovered(res: dict, dp: int = 1) -> None:
    assert res["victims"], "the drill never reached its kill point"
    assert res["rc"] == 0, (res["out"] / "logs" / "consumer-node0.log").read_text()[-3000:]
    assert not res["left"] and not res["spawned_alive"], (res["left"], res["spawned_alive"])
    led = res["report"]["ledger"]
    # every prompt trained exactly once: nothing lost, nothing duplicated
    assert led["duplicates"] == 0 and led["acked_not_committed"] == 0
    assert led["acked"] == led["acked_unique"] == led["committed"] == res["prompts"] == led["global_step"] * dp


def producer_just_ahead(plan, _tmp_path: Path):
    """Producer keeps at most 4 refs in flight, so it is still capturing when the server dies."""
    producer, consumer = plan.commands
    env = {**producer.env, "DISAGG_IN_FLIGHT_HIGH_WATERMARK": "4", "DISAGG_IN_FLIGHT_LOW_WATERMARK": "2"}
    return dataclasses.replace(plan, commands=(dataclasses.replace(producer, env=env), consumer))


def inject_consumer_crash(plan, tmp_path: Path):
    """Consumer ranks run ``fault_consumer`` (SIGKILL right after the step-3 checkpoint, once)."""
    producer, consumer = plan.commands
    argv = list(consumer.argv)
    i = argv.index("torch.distributed.run")
    j = argv.index("specforge_kimi", i)
    argv[j] = "fault_consumer"
    env = {
        **consumer.env,
        "FAULT_AFTER_SAVE_STEP": str(KILL_AFTER_STEP),
        "FAULT_MARKER": str(tmp_path / "crashed"),
        "PYTHONPATH": os.pathsep.join([str(INTEGRATION), os.environ.get("PYTHONPATH", "")]),
    }
    return dataclasses.replace(plan, commands=(producer, dataclasses.replace(consumer, argv=tuple(argv), env=env)))
