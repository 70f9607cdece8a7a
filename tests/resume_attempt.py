"""One launch of a resume drill's run, as its own process (the drill SIGKILLs it with everything it started):
``python tests/resume_attempt.py SETTINGS.json``.

Builds the run's plan the way the drill's kind says -- ``cpu``: the CPU plan of
``tests/integration/online_cpu.py`` (reference capture server); ``gpu``: ``recipes/tiny-k25-tp1-h200.yaml``
with real SGLang at TP=1 -- checks the recipe's input files (``plan.inputs``), then runs
``run.resume.run_attempts``: the same code ``specforge-kimi launch RECIPE [--resume]`` runs (the lock,
the attempt record, the reconciliation and cut-back, whole-run restarts), minus the machine preflight
(ports, installed patches) the CPU stand-ins do not pass. The consumer is
``tests/integration/resume_drill_consumer.py`` (plain ``specforge_kimi train`` unless ``slow_save`` asks
it to pause a checkpoint write). Every process it spawns is appended to ``pids`` (the drill kills their
groups); events (attempt start/end, with wall-clock times) go to ``events`` as JSON lines.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
sys.path[:0] = [str(TESTS), str(TESTS / "integration")]


def _event(settings: dict, **kw) -> None:
    with open(settings["events"], "a") as f:
        f.write(json.dumps({"t": time.time(), **kw}) + "\n")


def _gpu_plan(s: dict):
    import yaml

    from specforge_kimi.plan.run_plan import compile_plan
    from specforge_kimi.run.launch import build_colocated_plan
    from specforge_kimi.run.services import free_ports

    raw = yaml.safe_load((ROOT / "recipes" / "tiny-k25-tp1-h200.yaml").read_text())
    out = Path(s["root"]) / "run"
    rpc, meta, metrics, port = s.get("ports") or free_ports(4)
    raw["output_dir"] = str(out)
    raw["target"]["path"] = s["target"]
    raw["mooncake"] = {"rpc_port": rpc, "metadata_port": meta, "metrics_port": metrics, "global_segment_gib": 8}
    raw["server"]["port"] = port
    if s.get("transport"):  # the drills on the other transport than the recipe's
        raw["server"]["transport"] = s["transport"]
    raw["trainer"].update(max_steps=s["steps"], save_interval=s["save_interval"], num_epochs=s.get("num_epochs", 1))
    raw["data"] = {
        "prompts_path": str(Path(s["data"]) / "prompts.jsonl"),
        "vocab_mapping_path": str(Path(s["data"]) / "vocab_mapping.pt"),
    }
    raw["resilience"] = s.get("resilience") or {}
    compiled = compile_plan(raw, rendered_dir=out / "rendered")
    recipe = compiled.recipe
    compiled.write()
    cfg_path = out / "rendered" / "specforge_run.yaml"
    cfg = yaml.safe_load(cfg_path.read_text())
    cfg["training"]["log_interval"] = 1  # the drills key on "step N:" lines
    cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return build_colocated_plan(compiled, python=sys.executable), recipe


def _cpu_plan(s: dict):
    from online_cpu import cpu_plan

    plan, recipe, _rendered, _target = cpu_plan(
        Path(s["root"]),
        steps=s["steps"],
        save_interval=s["save_interval"],
        dp=s.get("dp", 1),
        resilience=s.get("resilience"),
        inputs=(Path(s["target"]), Path(s["data"])),
    )
    return plan, recipe


def _drill_consumer(plan, s: dict):
    """The consumer runs ``resume_drill_consumer`` (a pause inside one checkpoint write when asked)."""
    producer, consumer = plan.commands
    argv = list(consumer.argv)
    i = argv.index("torch.distributed.run")
    argv[argv.index("specforge_kimi", i)] = "resume_drill_consumer"
    env = {
        **consumer.env,
        "PYTHONPATH": os.pathsep.join([str(TESTS / "integration"), os.environ.get("PYTHONPATH", "")]),
        "RESUME_DRILL_FLAG": s["flag"],
    }
    if s.get("slow_save"):
        env["RESUME_DRILL_SLOW_SAVE"] = s["slow_save"]
    return dataclasses.replace(plan, commands=(producer, dataclasses.replace(consumer, argv=tuple(argv), env=env)))


def main() -> int:
    s = json.loads(Path(sys.argv[1]).read_text())
    from specforge_kimi.plan.inputs import require_inputs
    from specforge_kimi.run.launch import run_plan
    from specforge_kimi.run.resume import read_record, run_attempts

    plan, recipe = _gpu_plan(s) if s["kind"] == "gpu" else _cpu_plan(s)
    require_inputs(recipe)
    plan = _drill_consumer(plan, s)

    def popen(*a, **k):
        p = subprocess.Popen(*a, **k)
        with open(s["pids"], "a") as f:
            f.write(f"{p.pid}\n")
        return p

    def run(p) -> int:
        record = read_record(Path(recipe.output_dir))
        _event(s, event="attempt_start", attempt=len(record.attempts) if record else None, logs=p.services[0].log_path)
        rc = run_plan(p, managed_preflight=lambda _p: None, popen=popen)
        _event(s, event="attempt_end", rc=rc)
        return rc

    rc = run_attempts(
        recipe,
        plan,
        run,
        resume=s["resume"],
        stop_stale=True,
        restarts=recipe.resilience.run_restarts,
        say=lambda m: (print(m, flush=True), _event(s, event="say", text=m)),
    )
    _event(s, event="done", rc=rc)
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
