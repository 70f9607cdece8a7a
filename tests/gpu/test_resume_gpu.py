"""Issue 26's GPU drills on one H200, real SGLang at TP=1: ``recipes/tiny-k25-tp1-h200.yaml`` (Mooncake, the
text-only capture server, producer, one trainer rank, all on one GPU) under SpecForge's supervisor, driven by
``tests/resume_drills.py`` exactly as the CPU drills (``tests/integration/test_resume_cpu.py``):

- ``test_resume_gpu_kill_twice``: SIGKILL of every process group of the launch twice -- first right after a
  random optimizer step between checkpoints, then during a checkpoint write (a random phase of it) -- each
  followed by ``launch --resume``; expected wall time ~6 min (three server starts of ~90 s, 200 steps);
- ``test_resume_gpu_mooncake_master_killed``: the Mooncake master SIGKILLed at a random step under
  ``resilience.run_restarts: 1``; the attempt stops (bound ``STOP_BOUND_S``) and the launcher resumes the run
  by itself; expected wall time ~4.5 min (two server starts, the stop of ~40 s).

Run them in separate device calls (each within 10 minutes). Both check from SpecForge's ledger that every
prompt is trained exactly once and that the loss curve continues from the checkpoint, and write their
outcome -- lost / duplicated / captured-again counts, time from the kill to the resumed attempt's first
optimizer step, the stop time -- into ``$SPECFORGE_KIMI_GPU_OUT/resume_drills_<transport>_tp1_h200.json``
(the recipe's transport, cuda_ipc, or ``SPECFORGE_KIMI_DRILL_TRANSPORT=mooncake``). A random-weight tiny target
(8 layers, hidden 512) and 200 corpus conversations; the seed of the kill points is
``SPECFORGE_KIMI_DRILL_SEED`` (default: the clock), recorded.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

import pytest
from conftest import prepare_corpus
from resume_drills import Run, check_run, steps_logged

pytestmark = pytest.mark.gpu

PROMPTS = 200
SAVE = 20
STOP_BOUND_S = 60.0
OUT = Path(os.environ.get("SPECFORGE_KIMI_GPU_OUT") or "/tmp/specforge-kimi-gpu")
#: the feature transport the drills run on: the recipe's (cuda_ipc) unless set (mooncake)
TRANSPORT = os.environ.get("SPECFORGE_KIMI_DRILL_TRANSPORT") or None


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    from specforge_kimi.targets.tiny import TinySpec, write_tiny

    root = tmp_path_factory.mktemp("resume-gpu")
    target = write_tiny(root / "k25", TinySpec(layers=8, hidden=512), device="cuda")  # seconds, not ~25 s on CPU
    return target, prepare_corpus(root, PROMPTS, "--tokenizer", str(target))


def _run(tmp_path, inputs, resilience=None) -> Run:
    seed = int(os.environ.get("SPECFORGE_KIMI_DRILL_SEED") or time.time_ns() % 2**31)
    target, data = inputs
    settings = {
        "kind": "gpu",
        "steps": 1000,  # more than the epoch's 200: the run ends when every prompt is trained
        "save_interval": SAVE,
        "target": str(target),
        "data": str(data),
        "resilience": resilience,
        "transport": TRANSPORT,
    }
    return Run(tmp_path, settings, seed=seed)


def _transport() -> str:
    from specforge_kimi.plan.run_plan import load_recipe

    return (
        TRANSPORT
        or load_recipe(Path(__file__).resolve().parents[2] / "recipes" / "tiny-k25-tp1-h200.yaml").server.transport
    )


def _write(name: str, res: dict) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"resume_drills_{_transport()}_tp1_h200.json"
    doc = json.loads(path.read_text()) if path.is_file() else {}
    import torch

    doc.update(
        {
            "benchmark": "whole-run resume drills (issue 26)",
            "test": "tests/gpu/test_resume_gpu.py",
            "environment": {
                "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                "python": platform.python_version(),
                "torch": torch.__version__,
            },
            "recipe": "recipes/tiny-k25-tp1-h200.yaml (random-weight tiny target, 8 layers, hidden 512)",
            "transport": _transport(),
            "prompts": PROMPTS,
            "save_interval": SAVE,
        }
    )
    doc.setdefault("drills", {})[name] = {"date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **res}
    path.write_text(json.dumps(doc, indent=1))


def _checked(name: str, run: Run, rc: int, **extra) -> dict:
    """``check_run``'s numbers (or its failure) with ``extra``, written to the results file, then asserted."""
    try:
        assert rc == 0, (run.root / f"attempt{run.attempts}.log").read_text()[-3000:]
        res = {**check_run(run, prompts=PROMPTS, quantum=1, save_interval=SAVE), **extra}
    except AssertionError as exc:
        _write(name, {"failed": str(exc)[:4000], "rc": rc, "seed": run.seed, "record": run.record(), **extra})
        raise
    _write(name, res)
    return res


def test_resume_gpu_kill_twice(tmp_path, inputs):
    run = _run(tmp_path, inputs)
    first = run.rng.choice([k for k in range(SAVE + 1, 3 * SAVE) if k % SAVE])
    run.kill_at("before", first, resume=False)
    # ranks of the killed attempt go on training and saving until the next launch stops them (2026-12-04: killed
    # after step 2x, they reached step 79 and checkpoint 60), so the second kill is aimed at the resumed attempt's
    # first checkpoint write, whatever its step; the step is read back from the write
    second = run.kill_at("during", nth_save=1, resume=True)["step"]
    rc = run.finish()
    name = "SIGKILL of every process group, twice (between checkpoints; during a checkpoint write), --resume"
    _checked(name, run, rc, kill_steps=[first, second], phases=[k["phase"] for k in run.kills])


def test_resume_gpu_mooncake_master_killed(tmp_path, inputs):
    if _transport() != "mooncake":  # a cuda_ipc run starts no Mooncake master (run.launch)
        pytest.skip("the master drill runs on Mooncake: set SPECFORGE_KIMI_DRILL_TRANSPORT=mooncake")
    run = _run(tmp_path, inputs, resilience={"run_restarts": 1})
    step = run.rng.randint(SAVE + 1, 3 * SAVE)
    proc = run.start(resume=False)
    log = run.out / "logs" / "consumer-node0.log"
    deadline = time.monotonic() + 400
    while time.monotonic() < deadline and proc.poll() is None:
        if log.is_file() and step in steps_logged(log.read_text(errors="replace")):
            break
        time.sleep(0.05)
    master = [
        int(p)
        for p in Path(run.settings["pids"]).read_text().split()
        if "mooncake" in Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace")
    ]
    if not master:
        run._kill_all(proc)  # nothing of this drill may outlive it
        pytest.fail("no Mooncake master among the spawned processes")
    killed = time.time()
    for pid in master:
        os.kill(pid, 9)
    rc = run.wait(proc)
    ends = [e for e in run.events() if e.get("event") == "attempt_end"]
    stop_s = ends[0]["t"] - killed if ends else None
    res = _checked(
        "Mooncake master SIGKILL, resilience.run_restarts 1",
        run,
        rc,
        kill_step=step,
        stop_s=round(stop_s, 1) if stop_s is not None else None,
        stop_bound_s=STOP_BOUND_S,
        attempt_statuses=[e["rc"] for e in ends],
        time_to_first_resumed_step_s=round(run.first_step_at[2] - killed, 1) if 2 in run.first_step_at else None,
    )
    assert len(ends) == 2 and ends[0]["rc"] != 0 and ends[1]["rc"] == 0, ends
    assert 0 < stop_s < STOP_BOUND_S, stop_s
    assert res["attempts"][0]["ledger_step_before"] >= step
