"""The role keeper: restart accounting, consumer-resume precondition, signal handling; and the
plan a recipe's ``resilience`` section produces."""

from __future__ import annotations

import copy
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from specforge_kimi.run import keeper

ROOT = Path(__file__).resolve().parents[2]


def test_service_restarts_then_gives_up(tmp_path):
    count = tmp_path / "count"
    cmd = [
        sys.executable,
        "-c",
        f"import pathlib; p = pathlib.Path({str(count)!r}); "
        "p.write_text(str(int(p.read_text() or 0) + 1) if p.exists() else '1'); raise SystemExit(3)",
    ]
    rc = keeper.run(cmd, restarts=2, backoff=0.0)
    assert rc == 3 and count.read_text() == "3"  # first run + 2 restarts


def _ledger(run: Path, step: int) -> None:
    (run / "consumer-state").mkdir(parents=True)
    con = sqlite3.connect(run / "consumer-state" / "consumer.sqlite")
    con.execute("create table marker (k text primary key, v text)")
    con.execute("insert into marker values ('global_step', ?)", (str(step),))
    con.commit()
    con.close()


def _checkpoint(run: Path, run_id: str, step: int) -> None:
    d = run / f"{run_id}-step{step}"
    d.mkdir(parents=True)
    (d / "training_state.pt").write_bytes(b"x")
    latest = run / f"{run_id}-latest"
    if latest.is_symlink():
        latest.unlink()
    latest.symlink_to(d.name)


def test_consumer_resumes_only_at_a_checkpointed_step(tmp_path, capsys):
    run = tmp_path / "run"
    _ledger(run, 5)
    _checkpoint(run, "r", 4)
    argv_log = tmp_path / "argv"
    cmd = [
        sys.executable,
        "-c",
        f"import sys, pathlib; pathlib.Path({str(argv_log)!r}).write_text(' '.join(sys.argv)); raise SystemExit(1)",
    ]
    assert keeper.run(cmd, restarts=3, backoff=0.0, consumer=(run, "r")) == 1
    assert "durable step 5 != checkpoint step 4" in capsys.readouterr().err
    assert "resume_from" not in argv_log.read_text()  # not relaunched


def test_consumer_relaunched_with_resume_from(tmp_path, capsys):
    run = tmp_path / "run"
    _ledger(run, 4)
    _checkpoint(run, "r", 4)
    marker = tmp_path / "second"
    # fails the first time, succeeds when it carries the resume override
    envs = tmp_path / "envs"
    cmd = [
        sys.executable,
        "-c",
        "import os, sys, pathlib; ok = any(a.startswith('training.resume_from=') for a in sys.argv); "
        f"open({str(envs)!r}, 'a').write(os.environ['SPECFORGE_KIMI_CONSUMER_RESTARTABLE']); "
        f"ok and pathlib.Path({str(marker)!r}).write_text(sys.argv[-1]); raise SystemExit(0 if ok else 9)",
    ]
    assert keeper.run(cmd, restarts=1, backoff=0.0, consumer=(run, "r")) == 0
    assert marker.read_text() == f"training.resume_from={run / 'r-latest'}"
    assert envs.read_text() == "10"  # restartable on the first run, not on the last allowed one
    assert keeper.resume_argv(["a", "training.resume_from=x"], Path("/y")) == ["a", "training.resume_from=/y"]


def test_sigterm_stops_the_child_and_does_not_restart(tmp_path):
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "specforge_kimi.run.keeper",
            "--restarts",
            "5",
            "--",
            sys.executable,
            "-c",
            "import time; time.sleep(60)",
        ],
        start_new_session=True,
    )
    time.sleep(1.5)
    os.killpg(p.pid, signal.SIGTERM)  # what SpecForge's supervisor does
    assert p.wait(timeout=20) == 128 + signal.SIGTERM


def test_stop_during_the_back_off_spawns_no_new_child(monkeypatch):
    """Issue 32: SIGTERM while the keeper waits out its back-off ends it; no further child starts. In-process,
    so the children it starts are counted at ``Popen`` (a child killed right after its start leaves no trace)."""
    import threading

    started = []
    real_popen = subprocess.Popen

    def popen(*args, **kwargs):
        started.append(args[0])
        return real_popen(*args, **kwargs)

    backing_off = threading.Event()

    def say(msg):
        if "restart 1/3" in msg:  # said right before the back-off
            backing_off.set()

    def stop_when_backing_off():
        backing_off.wait(60)
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(keeper.subprocess, "Popen", popen)
    monkeypatch.setattr(keeper, "_say", say)
    monkeypatch.setitem(keeper._STOP, "signum", None)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    stopper = threading.Thread(target=stop_when_backing_off, daemon=True)
    stopper.start()
    try:
        rc = keeper.run([sys.executable, "-c", "raise SystemExit(1)"], restarts=3, backoff=10.0)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    stopper.join(5)
    assert rc == 128 + signal.SIGTERM
    assert len(started) == 1  # the first child only


def test_resilience_shapes_the_plan(tmp_path):
    from specforge_kimi.plan.recipes import Recipe
    from specforge_kimi.plan.run_plan import compile_plan
    from specforge_kimi.run.launch import build_colocated_plan

    raw = copy.deepcopy(yaml.safe_load((ROOT / "recipes" / "tiny-k25-tp2-h200x2.yaml").read_text()))
    raw["output_dir"] = str(tmp_path / "run")
    raw["resilience"] = {"segment_owner": "keeper", "server_restarts": 2, "consumer_restarts": 1, "keeper_port": 35999}
    compiled = compile_plan(raw, rendered_dir=tmp_path / "r")
    compiled.write()
    plan = build_colocated_plan(compiled, python=sys.executable)
    labels = [(s.command.label, s.phase) for s in plan.services]
    assert labels == [("mooncake", 0), ("segment-keeper", 1), ("capture-server", 2)]
    server = plan.services[2].command
    assert server.env["MOONCAKE_GLOBAL_SEGMENT_SIZE"] == "0"
    assert plan.services[1].command.env["MOONCAKE_GLOBAL_SEGMENT_SIZE"] == str(int(32 * 2**30))
    assert server.argv[:5] == (sys.executable, "-m", "specforge_kimi.run.keeper", "--restarts", "2")
    consumer = plan.commands[1].argv
    assert "specforge_kimi.run.keeper" in consumer and "--resume-consumer" in consumer
    assert 35999 in plan.managed_ports
    with pytest.raises(ValidationError, match="segment_owner"):
        Recipe.model_validate({**raw, "resilience": {"segment_owner": "somewhere"}})
