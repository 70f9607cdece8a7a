"""Whole-run resume, CPU-only pieces: the registration seams prompt-ids, fresh-channel and checkpoint-save, the checkpoint completion check, how
``--resume`` reconciles SpecForge's ledger with the checkpoints (and refuses when they disagree), the ledger
cut-back, the attempt plan, the run's lock and marked processes, and the whole-run restart policy. The
drills with real processes are ``tests/integration/test_resume_cpu.py``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specforge_kimi.errors import KimiInputError

RUN = "r"


@pytest.fixture(scope="module", autouse=True)
def _registered():
    import specforge_kimi

    specforge_kimi.register()


# -- prompt-ids: deterministic prompt ids, trained prompts left out -------------------------------------


def _plan(prompts, epoch=0, epochs=1, batch_size=4):
    import specforge.launch as sf_launch

    return [
        [p["task_id"] for p in batch]
        for batch in sf_launch._iter_epoch_online_prompt_batches(prompts, epoch, epochs, seed=5, batch_size=batch_size)
    ]


def test_resume_seam_prompt_ids_are_deterministic_and_skip_keeps_order(tmp_path, monkeypatch):
    import specforge.launch as sf_launch

    from specforge_kimi.registration import RESUME_SKIP_ENV, prompt_task_id

    prompts = [{"payload": {"input_ids": [i]}} for i in range(10)]
    order = sf_launch._epoch_prompt_indices(prompts, 0, seed=5)
    first = _plan(prompts)
    assert first == _plan(prompts)  # a second producer run names the prompts alike
    assert [i for b in first for i in b] == [prompt_task_id(0, i) for i in order]
    assert [len(b) for b in first] == [4, 4, 2]
    skip = tmp_path / "skip.txt"
    dropped = [prompt_task_id(0, order[1]), prompt_task_id(0, order[6])]
    skip.write_text("\n".join(dropped) + "\n")
    monkeypatch.setenv(RESUME_SKIP_ENV, str(skip))
    rest = [i for b in _plan(prompts) for i in b]
    assert rest == [prompt_task_id(0, i) for i in order if prompt_task_id(0, i) not in dropped]
    # SpecForge's own multi-epoch ids are left as SpecForge makes them
    assert _plan(prompts, epoch=1, epochs=2)[0][0] == prompt_task_id(
        1, sf_launch._epoch_prompt_indices(prompts, 1, seed=5)[0]
    )


# -- fresh-channel: RefDistributor on a fresh channel --------------------------------------------------------


class _Source:
    def __init__(self):
        self.marked = 0

    def seed_consumed(self):
        return 0

    def mark_consumed(self, n):
        self.marked += n


@pytest.mark.parametrize("fresh", [False, True])
def test_resume_seam_fresh_channel_keeps_backpressure(tmp_path, monkeypatch, fresh):
    from specforge.runtime.data_plane.ref_distributor import RefDistributor

    from specforge_kimi.registration import FRESH_CHANNEL_ENV

    if fresh:
        monkeypatch.setenv(FRESH_CHANNEL_ENV, "1")
    else:
        monkeypatch.delenv(FRESH_CHANNEL_ENV, raising=False)
    source = _Source()
    d = RefDistributor(
        source, object(), str(tmp_path), 1, feature_store=object(), refs_per_rank_step=1, skip_ids={"a", "b", "c"}
    )
    assert d._skip == {"a", "b", "c"}  # released samples are skipped either way
    # same channel: SpecForge repairs the consumed counter from them; a new channel never published them
    assert source.marked == (0 if fresh else 3)


# -- checkpoint-save: checkpoint completion marker -----------------------------------------------------------


def _save(out: Path, step: int, *, run_id: str = RUN, rank_state=True) -> Path:
    """A checkpoint as SpecForge's CheckpointManager writes it (one process), through the checkpoint-save seam."""
    from specforge.training.checkpoint import CheckpointManager

    state = {"global_step": step, "run_id": run_id, "world_size": 1, "draft_state_dict": {"w": step}}
    return Path(CheckpointManager(str(out), run_id).save(state, step, rank_state={"rng": step} if rank_state else None))


def test_resume_checkpoint_marker_written_and_checked(tmp_path):
    from specforge_kimi.registration import CHECKPOINT_COMPLETE
    from specforge_kimi.run.resume import checkpoint_problem

    ckpt = _save(tmp_path, 3)
    marker = json.loads((ckpt / CHECKPOINT_COMPLETE).read_text())
    assert marker["step"] == 3 and marker["run_id"] == RUN and marker["world_size"] == 1
    assert set(marker["files"]) == {"training_state.pt", "training_state_rank0.pt"}
    assert marker["files"]["training_state.pt"] == (ckpt / "training_state.pt").stat().st_size
    assert checkpoint_problem(ckpt, run_id=RUN, step=3, world_size=1) is None
    assert "world size" in checkpoint_problem(ckpt, run_id=RUN, step=3, world_size=2)
    rank = ckpt / "training_state_rank0.pt"
    rank.write_bytes(rank.read_bytes()[:-10])  # torn by a power loss
    assert "bytes, the marker recorded" in checkpoint_problem(ckpt, run_id=RUN, step=3, world_size=1)
    (ckpt / CHECKPOINT_COMPLETE).unlink()
    assert "no completion marker" in checkpoint_problem(ckpt, run_id=RUN, step=3, world_size=1)


def test_resume_checkpoint_shared_state_must_load(tmp_path):
    from specforge_kimi.registration import CHECKPOINT_COMPLETE
    from specforge_kimi.run.resume import checkpoint_problem

    ckpt = _save(tmp_path, 4)
    shared = ckpt / "training_state.pt"
    size = shared.stat().st_size
    shared.write_bytes(b"\0" * size)  # same size, not a checkpoint
    assert "does not load" in checkpoint_problem(ckpt, run_id=RUN, step=4, world_size=1)
    ckpt2 = _save(tmp_path / "b", 5)
    m = json.loads((ckpt2 / CHECKPOINT_COMPLETE).read_text())
    (ckpt2 / CHECKPOINT_COMPLETE).write_text(json.dumps({**m, "step": 6}))
    assert "completion marker says step 6" in checkpoint_problem(ckpt2, run_id=RUN, step=5, world_size=1)


class _RunsCode:
    """Unpickling this creates ``path``: stands for any code a pickle can name."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return (open, (str(self.path), "w"))


def _rewrite_state(ckpt: Path, state: dict, step: int) -> None:
    """``training_state.pt`` replaced by ``state``, the completion marker rewritten to its new size."""
    import torch

    from specforge_kimi.registration import _mark_checkpoint_complete

    torch.save(state, ckpt / "training_state.pt")
    _mark_checkpoint_complete(str(ckpt), run_id=RUN, step=step, world_size=1)


def test_resume_checkpoint_probe_runs_no_pickled_code(tmp_path):
    """Issue 32: probing every step directory must not unpickle arbitrary objects (weights_only)."""
    from specforge_kimi.run.resume import checkpoint_problem

    ckpt = _save(tmp_path, 3)
    ran = tmp_path / "pickle-ran-code"
    _rewrite_state(ckpt, {"global_step": 3, "run_id": RUN, "world_size": 1, "x": _RunsCode(ran)}, 3)
    why = checkpoint_problem(ckpt, run_id=RUN, step=3, world_size=1)
    assert not ran.exists()
    assert why is not None and "does not load (weights_only)" in why


def test_resume_checkpoint_probe_loads_specforge_shared_state(tmp_path):
    """What SpecForge 0.2.0's TrainerController.save_checkpoint puts in the shared file (draft weights, step
    counters, strategy, run id, world size, its checkpoint_extra, the replicated AdamW state) loads under
    weights_only, so real checkpoints stay resume targets."""
    import torch

    from specforge_kimi.run.resume import checkpoint_problem

    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    ckpt = _save(tmp_path, 7)
    state = {
        "draft_state_dict": model.state_dict(),
        "global_step": 7,
        "epoch": 0,
        "epoch_batch": 7,
        "epoch_samples": 14,
        "strategy": "eagle3",
        "run_id": RUN,
        "world_size": 1,
        "dataset_size": None,
        "batch_size": 2,
        "accumulation_steps": 1,
        "num_epochs": 1,
        "effective_total_steps": 100,
        "tp_size": 1,
        "sp_ulysses_size": 1,
        "sp_ring_size": 1,
        "replicated_optimizer_state": optimizer.state_dict(),
    }
    _rewrite_state(ckpt, state, 7)
    assert checkpoint_problem(ckpt, run_id=RUN, step=7, world_size=1) is None


# -- the ledger ----------------------------------------------------------------------------------------------


def _ledger(
    path: Path, *, q: int, steps: int, extra_committed: int = 0, ids=None, durable: bool = True, run_id: str = RUN
) -> list[str]:
    """A ledger SpecForge's own SQLiteMetadataStore wrote: ``steps`` optimizer steps of ``q`` samples each."""
    from specforge.runtime.contracts import SampleRef
    from specforge.runtime.control_plane.metadata_store import SQLiteMetadataStore

    from specforge_kimi.registration import prompt_task_id

    n = steps * q + extra_committed
    names = ids or [f"{run_id}:{prompt_task_id(0, i)}" for i in range(n)]
    path.parent.mkdir(parents=True, exist_ok=True)
    store = SQLiteMetadataStore(str(path))
    store.commit_samples(
        [
            SampleRef(
                sample_id=s,
                run_id=run_id,
                source_task_id=s.split(":", 1)[1],
                feature_store_uri="mooncake://",
                feature_keys={},
                feature_specs={},
                strategy="eagle3",
                num_tokens=3,
            )
            for s in names
        ]
    )
    for step in range(1, steps + 1):
        store.record_train_ack(names[(step - 1) * q : step * q], global_step=step, optimizer_durable=durable)
    store.close()
    return names


def _reconcile(out: Path, *, q: int):
    from specforge_kimi.run.resume import reconcile

    return reconcile(out, run_id=RUN, quantum=q, world_size=1, ledger=out / "consumer-state" / "consumer.sqlite")


def test_resume_reconcile_picks_newest_complete_checkpoint_and_first_s_q_rows(tmp_path):
    from specforge_kimi.registration import CHECKPOINT_COMPLETE

    names = _ledger(tmp_path / "consumer-state" / "consumer.sqlite", q=2, steps=7, extra_committed=3)
    for step in (3, 6):
        _save(tmp_path, step)  # one process, batch 2: Q = 2
    point = _reconcile(tmp_path, q=2)
    assert point.step == 6 and point.ledger_step == 7 and point.kept == tuple(names[:12])
    assert point.recaptured_acked == 2 and point.in_flight == 3 and point.abandoned == ()
    (tmp_path / f"{RUN}-step6" / CHECKPOINT_COMPLETE).unlink()  # died writing checkpoint 6
    point = _reconcile(tmp_path, q=2)
    assert point.step == 3 and point.kept == tuple(names[:6]) and point.recaptured_acked == 8
    assert [p.name for p in point.abandoned] == [f"{RUN}-step6"] and "no completion marker" in point.incomplete[
        f"{RUN}-step6"
    ]


def test_resume_reconcile_without_checkpoint_starts_over(tmp_path):
    from specforge_kimi.run.resume import cut_ledger

    db = tmp_path / "consumer-state" / "consumer.sqlite"
    _ledger(db, q=1, steps=2)
    point = _reconcile(tmp_path, q=1)
    assert point.step == 0 and point.checkpoint is None and point.kept == () and point.recaptured_acked == 2
    backup = db.with_name("consumer.sqlite.before-attempt2")
    cut_ledger(db, point, backup)
    # SpecForge starts a consumer without resume_from only where no ledger (nor its -wal/-shm) exists
    assert not [p for p in db.parent.iterdir() if p.name.startswith("consumer.sqlite") and p != backup]
    assert len(_ledger_ids(backup)) == 2


def _ledger_ids(db: Path) -> list[str]:
    import sqlite3

    con = sqlite3.connect(db)
    try:
        return [r[0] for r in con.execute("SELECT sample_id FROM acked ORDER BY rowid")]
    finally:
        con.close()


@pytest.mark.parametrize(
    "case, needle",
    [
        ("count", "ledger and optimizer steps disagree"),
        ("random_ids", "without deterministic prompt ids"),
        ("ahead", "is complete but the ledger's durable step is 2"),
        ("no_ledger", "but no ledger"),
        ("not_durable", "not marked optimizer_durable"),
    ],
)
def test_resume_reconcile_refuses_when_ledger_and_checkpoint_disagree(tmp_path, case, needle):
    db = tmp_path / "consumer-state" / "consumer.sqlite"
    if case == "count":
        _ledger(db, q=2, steps=3)
        call = {"q": 3}  # the recipe now trains 3 per step: 6 rows are not 3 x 3
    elif case == "random_ids":
        _ledger(db, q=1, steps=2, ids=[f"{RUN}:task-0123456789ab", f"{RUN}:task-ba9876543210"])
        call = {"q": 1}
    elif case == "ahead":
        _ledger(db, q=1, steps=2)
        _save(tmp_path, 3)
        call = {"q": 1}
    elif case == "no_ledger":
        _save(tmp_path, 3)
        call = {"q": 1}
    else:
        _ledger(db, q=1, steps=2, durable=False)
        call = {"q": 1}
    with pytest.raises(KimiInputError, match=needle):
        _reconcile(tmp_path, **call)


def test_resume_cut_ledger_keeps_what_the_checkpoint_holds(tmp_path):
    from specforge.runtime.control_plane.metadata_store import SQLiteMetadataStore

    from specforge_kimi.run.resume import cut_ledger

    db = tmp_path / "consumer-state" / "consumer.sqlite"
    names = _ledger(db, q=2, steps=5, extra_committed=2)
    _save(tmp_path, 3)
    point = _reconcile(tmp_path, q=2)
    backup = db.with_name("consumer.sqlite.before-attempt2")
    cut_ledger(db, point, backup)
    store = SQLiteMetadataStore(str(db))
    marker = store.durable_marker()
    assert marker["global_step"] == 3 and marker["optimizer_durable"] is True
    assert marker["acked"] == set(names[:6]) and store.all_committed_ids() == names[:6]
    store.close()
    old = SQLiteMetadataStore(str(backup))
    assert old.durable_marker()["global_step"] == 5 and old.committed_count() == 12
    old.close()
    # a second --resume after an interrupted one finds the same point (idempotent)
    assert _reconcile(tmp_path, q=2).kept == point.kept


# -- attempts: the record, the lock, marked processes, the plan --------------------------------------------


def _recipe_and_plan(tmp_path: Path):
    import yaml

    from specforge_kimi.plan.run_plan import compile_plan
    from specforge_kimi.run.launch import build_colocated_plan

    root = Path(__file__).resolve().parents[2]
    raw = yaml.safe_load((root / "recipes" / "tiny-k25-tp1-h200.yaml").read_text())
    raw["output_dir"] = str(tmp_path / "run")
    raw["resilience"] = {"consumer_restarts": 1}
    compiled = compile_plan(raw, rendered_dir=tmp_path / "run" / "rendered")
    compiled.write()
    return compiled.recipe, build_colocated_plan(compiled, python=sys.executable)


def _argv(plan, label):
    return next(c for c in plan.commands if c.label == label).argv


def test_resume_first_attempt_recorded_and_a_second_launch_refused(tmp_path):
    from specforge_kimi.run import resume, run_guard

    recipe, plan = _recipe_and_plan(tmp_path)
    out = Path(recipe.output_dir)
    marked = resume.begin_attempt(recipe, plan, resume=False)
    record = resume.read_record(out)
    assert record.run_id == recipe.name and record.consumer_quantum == 1 and len(record.attempts) == 1
    mark = str(out.resolve())
    assert all(c.env[run_guard.RUN_DIR_ENV] == mark for c in marked.commands)
    assert all(s.command.env[run_guard.RUN_DIR_ENV] == mark for s in marked.services)
    with pytest.raises(KimiInputError, match="launch RECIPE --resume"):
        resume.begin_attempt(recipe, plan, resume=False)
    run_guard.release_lock(out)


def test_resume_attempt_plan_and_record(tmp_path, capsys):
    from specforge_kimi.registration import FRESH_CHANNEL_ENV, RESUME_SKIP_ENV
    from specforge_kimi.run import resume, run_guard

    recipe, plan = _recipe_and_plan(tmp_path)
    out = Path(recipe.output_dir)
    resume.begin_attempt(recipe, plan, resume=False)
    (out / "supervisor").mkdir()
    names = _ledger(out / "consumer-state" / "consumer.sqlite", q=1, steps=5, extra_committed=1, run_id=recipe.name)
    _save(out, 2, run_id=recipe.name)
    _save(out, 4, run_id=recipe.name)
    (out / f"{recipe.name}-step4" / "specforge_kimi_complete.json").unlink()  # died writing checkpoint 4
    new = resume.begin_attempt(recipe, plan, resume=True)
    rec = resume.read_record(out).attempts[-1]
    assert rec.attempt == 2 and rec.resumed_from_step == 2 and rec.ledger_step_before == 5
    assert rec.trained_kept == 2 and rec.recaptured_acked == 3 and rec.recaptured_in_flight == 1
    assert rec.abandoned == [f"{recipe.name}-step4.abandoned-attempt2"]
    assert (out / f"{recipe.name}-latest").resolve().name == f"{recipe.name}-step2"
    assert Path(rec.skip_file).read_text().split() == [n.split(":", 1)[1] for n in names[:2]]
    consumer, producer = _argv(new, "consumer"), _argv(new, "producer")
    assert consumer[-1] == f"training.resume_from={out / f'{recipe.name}-step2'}"
    assert str(out / "rendered" / "specforge_run.attempt2.yaml") in consumer and str(out / "logs-attempt2") in " ".join(
        producer
    )
    import yaml

    cfg = yaml.safe_load((out / "rendered" / "specforge_run.attempt2.yaml").read_text())
    assert cfg["deployment"]["disaggregated"]["control_dir"] == str(out / "control-attempt2")
    assert new.managed_root == str(out / "supervisor-attempt2")
    assert all(Path(s.log_path).parent == out / "logs-attempt2" for s in new.services)
    env = next(c for c in new.commands if c.label == "producer").env
    assert env[RESUME_SKIP_ENV] == rec.skip_file and env[FRESH_CHANNEL_ENV] == "1"
    assert "resuming run" in capsys.readouterr().out
    run_guard.release_lock(out)


class _Killed(BaseException):
    """A kill -9 of ``--resume``: nothing of ours runs after it."""


def test_resume_interrupted_twice_never_overwrites_the_ledger_backup(tmp_path, monkeypatch):
    """Issue 32: ``--resume`` killed after the ledger cut (before the attempt is recorded), then ``--resume``
    again: the first backup -- the only copy of the ledger before any cut -- stays as it was."""
    from specforge.runtime.control_plane.metadata_store import SQLiteMetadataStore

    from specforge_kimi.run import resume, run_guard

    recipe, plan = _recipe_and_plan(tmp_path)
    out = Path(recipe.output_dir)
    resume.begin_attempt(recipe, plan, resume=False)
    (out / "supervisor").mkdir()
    db = out / "consumer-state" / "consumer.sqlite"
    _ledger(db, q=1, steps=5, run_id=recipe.name)
    _save(out, 2, run_id=recipe.name)

    def killed(*_a, **_k):
        raise _Killed

    monkeypatch.setattr(resume, "write_record", killed)
    with pytest.raises(_Killed):
        resume.begin_attempt(recipe, plan, resume=True)
    monkeypatch.undo()
    first = db.with_name("consumer.sqlite.before-attempt2")
    before = first.read_bytes()
    resume.begin_attempt(recipe, plan, resume=True)
    assert first.read_bytes() == before
    old = SQLiteMetadataStore(str(first))
    assert old.durable_marker()["global_step"] == 5  # the ledger before any cut
    old.close()
    rec = resume.read_record(out).attempts[-1]
    assert rec.attempt == 2 and rec.ledger_backup == str(db.with_name("consumer.sqlite.before-attempt2-2"))
    assert not [p for p in db.parent.iterdir() if p.name.endswith(".tmp")]
    run_guard.release_lock(out)


def test_resume_refuses_while_processes_of_the_run_live_and_stops_them_when_asked(tmp_path):
    from specforge_kimi.run import resume, run_guard

    recipe, plan = _recipe_and_plan(tmp_path)
    out = Path(recipe.output_dir)
    resume.begin_attempt(recipe, plan, resume=False)
    (out / "supervisor").mkdir()
    env = {**os.environ, run_guard.RUN_DIR_ENV: str(out.resolve())}
    orphan = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], env=env, start_new_session=True)
    try:
        time.sleep(0.3)
        assert [pid for pid, _ in run_guard.run_processes(out)] == [orphan.pid]
        with pytest.raises(KimiInputError, match=f"still run \\({orphan.pid} .*--stop-stale"):
            resume.begin_attempt(recipe, plan, resume=True)
        resume.begin_attempt(recipe, plan, resume=True, stop_stale=True)
        assert orphan.wait(timeout=15) != 0
        assert resume.read_record(out).attempts[-1].stale_stopped == [orphan.pid]
    finally:
        if orphan.poll() is None:
            orphan.kill()
        run_guard.release_lock(out)


def test_resume_lock_refuses_a_second_launcher(tmp_path):
    from specforge_kimi.run import run_guard

    src = Path(__file__).resolve().parents[2] / "src"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; from specforge_kimi.run import run_guard; "
            "run_guard.acquire_lock(Path(sys.argv[1])); print('held', flush=True); time.sleep(60)",
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(src)},
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(KimiInputError, match=f"another launch .* is running \\(pid {holder.pid}"):
            run_guard.acquire_lock(tmp_path)
    finally:
        holder.kill()
        holder.wait()
    run_guard.acquire_lock(tmp_path)  # released by the kernel when the holder died
    run_guard.release_lock(tmp_path)


def test_resume_without_a_record_is_refused(tmp_path):
    from specforge_kimi.run import resume, run_guard

    recipe, plan = _recipe_and_plan(tmp_path)
    out = Path(recipe.output_dir)
    with pytest.raises(KimiInputError, match="launch it without --resume"):
        resume.begin_attempt(recipe, plan, resume=True)
    (out / "supervisor").mkdir()
    with pytest.raises(KimiInputError, match="before whole-run resume existed"):
        resume.begin_attempt(recipe, plan, resume=True)
    run_guard.release_lock(out)


# -- whole-run restarts ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "statuses, progress, runs",
    [
        ([0], [], 1),  # success: done
        ([1, 0], [3], 2),  # failed after progress: resumed once, then done
        ([1, 1], [3, 3], 2),  # restarts used up (1)
        ([130], [5], 1),  # Ctrl-C: never restarted
        ([1], [0], 1),  # no durable step: would fail the same way again
    ],
)
def test_resume_run_restarts_policy(tmp_path, monkeypatch, statuses, progress, runs):
    from specforge_kimi.run import ledger, resume

    calls = []
    monkeypatch.setattr(resume, "begin_attempt", lambda recipe, plan, **kw: calls.append(kw) or plan)
    monkeypatch.setattr(resume, "read_record", lambda out: None)
    steps = iter(progress)
    monkeypatch.setattr(ledger, "durable_step", lambda out: next(steps))
    ran = iter(statuses)
    seen = []

    def run(plan):
        seen.append(plan)
        return next(ran)

    class R:
        output_dir = str(tmp_path)
        server = type("S", (), {"transport": "mooncake"})  # no cuda_ipc pools to clear around the attempts

    rc = resume.run_attempts(R(), "plan", run, resume=False, restarts=1, say=lambda m: None)
    assert len(seen) == runs and rc == statuses[runs - 1]
    assert calls[0]["resume"] is False and calls[0]["stop_stale"] is False
    assert all(c["resume"] and c["stop_stale"] for c in calls[1:])


def test_resume_run_report_reads_every_attempt(tmp_path):
    """``run-report`` on a resumed run: the steps of every attempt's log, a retrained step as the later attempt
    logged it; set-aside checkpoint directories are not checkpoints."""
    import yaml

    from specforge_kimi.evaluate.run_report import report

    run = tmp_path / "run"
    (run / "rendered").mkdir(parents=True)
    (run / "rendered" / "specforge_run.yaml").write_text(yaml.safe_dump({"run_id": RUN, "training": {"max_steps": 6}}))

    def log(d: str, steps: dict[int, float]) -> None:
        (run / d).mkdir()
        (run / d / "consumer-node0.log").write_text("".join(f"step {s}: {{'loss': {v}}}\n" for s, v in steps.items()))

    log("logs", {1: 5.0, 2: 4.0, 3: 3.0, 4: 9.0})  # killed after step 4; checkpoint 3
    log("logs-attempt2", {4: 2.5, 5: 2.0, 6: 1.5})
    _save(run, 3)
    _save(run, 6)
    (run / f"{RUN}-step6").rename(run / f"{RUN}-step6.abandoned-attempt2")
    _save(run, 6)
    rep = report(run)
    assert rep["losses"] == [5.0, 4.0, 3.0, 2.5, 2.0, 1.5] and rep["last_step"] == 6
    assert rep["checkpoints"] == [f"{RUN}-step3", f"{RUN}-step6"]


def test_drill_step_lines_read_with_and_without_a_tracker():
    """The drills compare lr and loss across attempts; SpecForge prefixes them ``train/`` when a tracker is on
    (the recipes' default), and an interleaved second rank's write cuts a line the reader must skip."""
    from resume_drills import steps_logged

    plain = "step 3: {'loss': 2.5, 'lr': 0.001}\n"
    tracked = "step 3: {'train/loss': 2.5, 'train/lr': 0.001}\n"
    assert steps_logged(plain) == steps_logged(tracked) == {3: {"loss": 2.5, "lr": 0.001}}
    cut = "step 4: {'train/loss': 2.0, 'trstep 4: {'train/loss': 2.0, 'train/lr': 0.002}\n"
    assert steps_logged(cut) == {4: {"loss": 2.0, "lr": 0.002}}


def test_drill_kill_points_must_lie_past_the_resume_point(tmp_path):
    """The drills' second kill is aimed past the checkpoint the resumed attempt starts from (a kill can land many
    fast steps after its target: on one H200, 2026-12-03, one aimed below step 40 landed at 75, past two
    checkpoints, and the next kill, aimed at step 60, waited for a step that was never logged again)."""
    import random

    from resume_drills import Run

    run = Run(tmp_path, {"kind": "cpu"}, seed=1)
    assert run.resume_point() == 0  # nothing launched yet
    run.out.mkdir()
    (run.out / "resume.json").write_text(json.dumps({"run_id": "r"}))
    for step, complete in ((20, True), (40, True), (60, True), (80, False)):
        (run.out / f"r-step{step}").mkdir()
        if complete:
            (run.out / f"r-step{step}" / "specforge_kimi_complete.json").write_text("{}")
    (run.out / "r-step100.abandoned-attempt2").mkdir()
    assert run.resume_point() == 60
    run.rng = random.Random(0)
    with pytest.raises(AssertionError, match="step 60 cannot be reached: the resumed run starts after checkpoint 60"):
        run.kill_at("during", 60, resume=True)
    assert run.attempts == 0  # refused before any attempt was started


def test_drill_kill_point_is_a_step_or_an_nth_save(tmp_path):
    """``kill_at`` takes a step, or for ``during`` the attempt's n-th checkpoint write; neither or both is refused
    before any attempt starts."""
    from resume_drills import Run

    run = Run(tmp_path, {"kind": "cpu"}, seed=1)
    for kind, kw in (
        ("during", {}),
        ("during", {"step": 20, "nth_save": 1}),
        ("before", {"nth_save": 1}),
        ("during", {"nth_save": 0}),
    ):
        with pytest.raises(ValueError, match="one of step, nth_save"):
            run.kill_at(kind, resume=True, **kw)
    assert run.attempts == 0


@pytest.mark.parametrize("transport", [None, "mooncake"])
def test_gpu_drill_plan_runs_on_the_transport_asked(tmp_path, transport):
    """The GPU drills' attempt (``tests/resume_attempt.py``, kind gpu) renders the TP=1 recipe on its own
    transport (cuda_ipc) unless the drill names another (``SPECFORGE_KIMI_DRILL_TRANSPORT``)."""
    import resume_attempt

    from specforge_kimi.cli import main as cli
    from specforge_kimi.evaluate.run_report import transport as rendered_transport

    assert cli(["tiny", str(tmp_path / "t"), "--layers", "8", "--hidden", "64"]) == 0
    (tmp_path / "data").mkdir()
    settings = {"root": str(tmp_path / "r"), "target": str(tmp_path / "t"), "data": str(tmp_path / "data")}
    _, recipe = resume_attempt._gpu_plan({**settings, "steps": 10, "save_interval": 5, "transport": transport})
    want = transport or "cuda_ipc"
    assert recipe.server.transport == want and rendered_transport(Path(recipe.output_dir)) == want
