"""Whole-run resume drills on CPU (real Mooncake, SpecForge's producer, torchrun consumer and supervisor; the
CPU reference capture server in SGLang's place): SIGKILL of the launcher's process group and every process
group it started, at random points -- right after an optimizer step between checkpoints, right after a
checkpoint, during a checkpoint write -- three times per run, then ``--resume`` each time, and a Mooncake
master killed under ``resilience.run_restarts``. Checked from SpecForge's ledger, the attempt record and the
consumer logs (``resume_drills.check_run``): every prompt of the epoch trained exactly once, each attempt
resumed from the newest complete checkpoint, the loss curve continues from it, nothing left running.

The kill points are drawn from ``SPECFORGE_KIMI_DRILL_SEED`` (default: the clock; each test prints the seed
it used). One tiny target and one prepared corpus serve every test of the module. Outcomes are appended to
``$SPECFORGE_KIMI_DRILL_OUT`` (JSON lines) when set.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from online_cpu import cpu_inputs
from resume_drills import Run, check_run, steps_logged

pytestmark = pytest.mark.slow

PROMPTS = 40
SAVE = 3
KILLS = 3
STOP_BOUND_S = 60.0  # kill -> the failed attempt returned: supervisor's 30 s SIGTERM grace + detection


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume-inputs")
    return cpu_inputs(root, PROMPTS)


def _seed() -> int:
    seed = int(os.environ.get("SPECFORGE_KIMI_DRILL_SEED") or time.time_ns() % 2**31)
    print(f"drill seed {seed} (SPECFORGE_KIMI_DRILL_SEED={seed} repeats these kill points)")
    return seed


def _run(tmp_path, inputs, *, dp: int = 1, resilience: dict | None = None) -> Run:
    target, data = inputs
    settings = {
        "kind": "cpu",
        "steps": 200,  # more than the epoch: the run ends when every prompt is trained
        "save_interval": SAVE,
        "dp": dp,
        "target": str(target),
        "data": str(data),
        "resilience": resilience,
    }
    return Run(tmp_path, settings, seed=_seed())


def _record(name: str, res: dict) -> None:
    target = os.environ.get("SPECFORGE_KIMI_DRILL_OUT")
    if target:
        with open(target, "a") as f:
            f.write(json.dumps({"drill": name, **res}) + "\n")


def _chain(run: Run, kind: str, steps: list[int], *, dp: int) -> dict:
    for i, step in enumerate(steps):
        run.kill_at(kind, step, resume=i > 0)
    rc = run.finish()
    assert rc == 0, (run.root / f"attempt{run.attempts}.log").read_text()[-3000:]
    res = check_run(run, prompts=PROMPTS, quantum=dp, save_interval=SAVE)
    res["kill_steps"] = steps
    res["phases"] = [k["phase"] for k in run.kills]
    return res


def _points(run: Run, *, last: int, multiples: bool, again: bool = False) -> list[int]:
    """``KILLS`` increasing kill steps (optimizer steps), each reachable after resuming from the previous."""
    steps, lo = [], 1
    for _ in range(KILLS):
        pool = [k for k in range(lo, min(lo + 2 * SAVE, last + 1)) if (k % SAVE == 0) == multiples]
        step = run.rng.choice(pool)
        steps.append(step)
        lo = step if again else step + 1
    return steps


def test_resume_after_kill_before_checkpoint(tmp_path, inputs):
    run = _run(tmp_path, inputs)
    res = _chain(run, "before", _points(run, last=PROMPTS - 2, multiples=False), dp=1)
    _record("resume: SIGKILL all between checkpoints, x3", res)
    assert all(a["recaptured_acked"] >= 1 for a in res["attempts"]), res  # a kill between checkpoints loses steps


def test_resume_after_kill_right_after_checkpoint(tmp_path, inputs):
    run = _run(tmp_path, inputs)
    res = _chain(run, "after", _points(run, last=PROMPTS - SAVE, multiples=True), dp=1)
    _record("resume: SIGKILL all right after a checkpoint, x3", res)


def test_resume_after_kill_during_checkpoint_write(tmp_path, inputs):
    """Two trainer ranks (Q = 2): the completion marker waits for both ranks' files."""
    run = _run(tmp_path, inputs, dp=2)
    res = _chain(run, "during", _points(run, last=PROMPTS // 2 - SAVE, multiples=True, again=True), dp=2)
    _record("resume: SIGKILL all during a checkpoint write (2 ranks), x3", res)


def test_resume_kill_between_checkpoints_then_during_the_resumed_first_write(tmp_path, inputs):
    """The GPU kill-twice drill's sequence (``tests/gpu/test_resume_gpu.py``): the second kill is aimed at the
    resumed attempt's first checkpoint write (``nth_save``), whose step is known only once that attempt resumed."""
    run = _run(tmp_path, inputs)
    first = run.rng.choice([k for k in range(SAVE + 1, 3 * SAVE) if k % SAVE])
    run.kill_at("before", first, resume=False)
    event = run.kill_at("during", nth_save=1, resume=True)
    assert event["step"] > run.record()["attempts"][1]["resumed_from_step"] and event["step"] % SAVE == 0, event
    rc = run.finish()
    assert rc == 0, (run.root / f"attempt{run.attempts}.log").read_text()[-3000:]
    res = check_run(run, prompts=PROMPTS, quantum=1, save_interval=SAVE)  # the second kill's step, as recorded
    _record("resume: SIGKILL all between checkpoints, then during the resumed first write", res)


def test_resume_after_mooncake_master_killed(tmp_path, inputs):
    """``resilience.run_restarts: 1``: the master's loss stops the attempt (every object is gone and SpecForge
    cannot capture a lost ref again); the launcher resumes the run by itself."""
    run = _run(tmp_path, inputs, resilience={"run_restarts": 1})
    step = run.rng.randint(2, 8)
    proc = run.start(resume=False)
    log = run.out / "logs" / "consumer-node0.log"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and proc.poll() is None:
        if log.is_file() and step in steps_logged(log.read_text(errors="replace")):
            break
        time.sleep(0.05)
    master = [
        int(p)
        for p in Path(run.settings["pids"]).read_text().split()
        if "mooncake"
        in Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace")  # mooncake.cli execs mooncake_master
    ]
    assert master, "no Mooncake master among the spawned processes"
    killed = time.time()
    for pid in master:
        os.kill(pid, 9)
    rc = run.wait(proc)
    assert rc == 0, (run.root / "attempt1.log").read_text()[-3000:]
    ends = [e for e in run.events() if e.get("event") == "attempt_end"]
    assert len(ends) == 2 and ends[0]["rc"] != 0 and ends[1]["rc"] == 0, ends
    stop_s = ends[0]["t"] - killed
    assert 0 < stop_s < STOP_BOUND_S, stop_s
    assert 2 in run.first_step_at, "the resumed attempt logged no step"
    res = check_run(run, prompts=PROMPTS, quantum=1, save_interval=SAVE)  # the restart was the launcher's own
    res.update(
        kill_step=step, stop_s=round(stop_s, 1), time_to_first_resumed_step_s=round(run.first_step_at[2] - killed, 1)
    )
    _record("resume: Mooncake master SIGKILL, resilience.run_restarts 1", res)
    assert res["attempts"][0]["ledger_step_before"] >= step
