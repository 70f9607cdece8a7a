"""Whole-run resume: ``specforge-kimi launch RECIPE --resume`` continues an interrupted run from its newest
complete checkpoint -- after a lost node, a ``kill -9`` of the whole process tree, a crash between
checkpoints or a lost Mooncake master. Every service starts afresh; samples trained into the checkpoint are
not trained again; samples acknowledged after it, lost with the memory they lived in, are captured again.

Scope: single-node recipes (node 0 holds SpecForge's ledger and starts Mooncake, the server and the
producer). Each launch of a run directory is an *attempt*, recorded in ``<output_dir>/resume.json``:
attempt 1 uses ``control/``, ``supervisor/`` and ``logs/``; attempt k > 1 uses ``control-attempt{k}/``,
``supervisor-attempt{k}/``, ``logs-attempt{k}/`` and ``rendered/specforge_run.attempt{k}.yaml`` (the same
SpecForge config with that control directory: SpecForge's producer refuses a channel an earlier attempt
wrote, and its supervisor a logs directory that exists). Without ``--resume`` a run directory that holds an
attempt is refused, with the fix named.

How ledger and checkpoint are reconciled. SpecForge's consumer ledger (``consumer.sqlite``, written by
rank 0 only) is the record of what was trained; the checkpoint holds the weights, optimizer, scheduler and
RNG; the registration seams ``prompt-ids``, ``fresh-channel`` and ``checkpoint-save`` make both usable:

- every optimizer step acknowledges exactly ``Q = dp x batch x accumulation`` samples in one transaction,
  after the step and before any checkpoint of it, and sets ``marker.global_step``. So a ledger at durable
  step ``M`` holds ``M x Q`` acknowledged rows, in step order by rowid, and the samples trained into
  checkpoint ``S <= M`` are its first ``S x Q`` rows;
- sample ids are ``<run_id>:epoch{e:04d}-prompt{i:012d}`` (``prompt-ids``), so a row names a prompt of the
  dataset across attempts;
- a checkpoint counts only with its completion marker (``checkpoint-save``), its files at the sizes the marker
  recorded, and a shared state that loads with ``global_step == S``, the run id and the world size.

``--resume`` takes ``S`` = the newest complete checkpoint with ``S <= M`` (0 when there is none: the run
starts over, every sample captured again, on no ledger), backs the ledger up
(``consumer.sqlite.before-attempt{k}``, or ``...-2`` beside one an interrupted ``--resume`` left: a backup is
never overwritten), cuts it back in one transaction to the first ``S x Q`` acknowledged
rows and their committed refs with marker ``S``, renames step directories past ``S`` to ``*.abandoned-attempt{k}``, points ``-latest`` at
``S`` (atomically), and starts attempt k: the consumer with SpecForge's own ``training.resume_from=S``
(which reconciles the cut ledger, releases those samples and restores the optimizer boundary), the
producer leaving the ``S x Q`` trained prompts out of its plan (``prompt-ids``), on a new channel (``fresh-channel``).

It refuses, with a one-line error and nothing changed, when they disagree instead of guessing: no
ledger beside checkpoints; acknowledged rows != ``M x Q``; a marker not ``optimizer_durable``;
acknowledged samples never committed; sample ids not of the ``prompt-ids`` form (a run started by a specforge-kimi
without that seam);
a complete checkpoint ahead of the ledger's durable step; a ``Q`` other than the previous attempt's (other
GPUs, batch or accumulation); processes of the previous attempt still alive (:mod:`run_guard`;
``--stop-stale`` stops them). A checkpoint without its marker, with a file of another size, or whose state
names another step, run or world size is not a resume target: it is set aside like a half-written one.

Cost: SpecForge's consumer resume asks Mooncake to remove every released sample's objects (gone with the
old master: each remove answers "not found"), two RPCs per feature key per sample trained into S; measured
only at the drills' sizes (tens of samples), not at a K2.5 run's millions.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sqlite3
import time
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from specforge_kimi.durable import fsync_path, write_atomic
from specforge_kimi.errors import KimiInputError
from specforge_kimi.registration import (
    CHECKPOINT_COMPLETE,
    CHECKPOINT_COMPLETE_FORMAT,
    FRESH_CHANNEL_ENV,
    RESUME_SKIP_ENV,
)
from specforge_kimi.run import run_guard

RECORD_FILE = "resume.json"
RECORD_FORMAT = "specforge-kimi/run-attempts/v1"
_TASK_ID = re.compile(r"^epoch\d{4}-prompt\d{12}$")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Attempt(_Strict):
    attempt: int = Field(ge=1, description="1 for the first launch, then one more per --resume")
    started_utc: str = Field(description="When the attempt was prepared")
    config: str = Field(description="SpecForge run config the attempt's producer and consumer read")
    control_dir: str = Field(description="The attempt's ref channel directory (new for every attempt)")
    supervisor_dir: str = Field(description="SpecForge supervisor directory of the attempt")
    logs_dir: str = Field(description="Role and service logs of the attempt")
    resumed_from_step: int | None = Field(default=None, description="Checkpoint step S it resumed from (None: first)")
    checkpoint: str | None = Field(default=None, description="The checkpoint directory it resumed from")
    ledger_step_before: int | None = Field(default=None, description="Ledger durable step M before the cut")
    trained_kept: int = Field(default=0, description="Samples trained into the checkpoint: left out, not retrained")
    recaptured_acked: int = Field(
        default=0, description="Samples acknowledged after the checkpoint: lost with the old run, captured again"
    )
    recaptured_in_flight: int = Field(default=0, description="Samples committed but never acknowledged: captured again")
    abandoned: list[str] = Field(default_factory=list, description="Step directories past S, renamed aside")
    incomplete: dict[str, str] = Field(default_factory=dict, description="Why each abandoned checkpoint was not loaded")
    stale_stopped: list[int] = Field(default_factory=list, description="Pids of the previous attempt stopped first")
    ledger_backup: str | None = Field(default=None, description="Copy of the ledger before the cut")
    skip_file: str | None = Field(default=None, description="Task ids the producer leaves out (the prompt-ids seam)")


class RunRecord(_Strict):
    format: Literal["specforge-kimi/run-attempts/v1"] = RECORD_FORMAT
    run_id: str = Field(description="The recipe's name = SpecForge's run_id")
    consumer_quantum: int = Field(gt=0, description="Q: samples acknowledged per optimizer step")
    attempts: list[Attempt] = Field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class ResumePoint:
    """What ``--resume`` will do, decided by :func:`reconcile` before anything changes."""

    step: int  # S
    checkpoint: Path | None  # <out>/<run_id>-step<S>, None when S == 0
    ledger_step: int  # M
    quantum: int  # Q
    kept: tuple[str, ...]  # sample ids trained into S: the first S x Q acknowledged rows
    recaptured_acked: int  # (M - S) x Q
    in_flight: int  # committed, never acknowledged
    abandoned: tuple[Path, ...]  # step directories past S
    incomplete: dict[str, str]  # step directory name -> why it is not a resume target


def _utc() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def run_started(record: RunRecord | None) -> float:
    """Epoch seconds when the run's first attempt was prepared, one second early (the stamp drops the fraction);
    now for a run without one."""
    import calendar

    if record is None or not record.attempts:
        return time.time()
    return calendar.timegm(time.strptime(record.attempts[0].started_utc, "%Y-%m-%dT%H:%M:%SZ")) - 1.0


def read_record(out: Path) -> RunRecord | None:
    path = Path(out) / RECORD_FILE
    if not path.is_file():
        return None
    return RunRecord.model_validate_json(path.read_text())


def write_record(out: Path, record: RunRecord) -> None:
    write_atomic(Path(out) / RECORD_FILE, record.model_dump_json(indent=1))


def consumer_quantum(config: dict) -> int:
    """Q = data-parallel ranks x batch x accumulation, from a rendered SpecForge config."""
    tr, dep = config["training"], config["deployment"]["trainer"]
    return (
        int(dep["nnodes"]) * int(dep["nproc_per_node"]) * int(tr["batch_size"]) * int(tr.get("accumulation_steps", 1))
    )


# -- checkpoints -------------------------------------------------------------------------------------------


def checkpoint_problem(ckpt: Path, *, run_id: str, step: int, world_size: int) -> str | None:
    """Why ``ckpt`` is not a checkpoint to resume from, or None: it needs the ``checkpoint-save`` seam's completion
    marker, its files at the recorded sizes, and a shared state that loads with this step, run id and world size."""
    marker = ckpt / CHECKPOINT_COMPLETE
    if not marker.is_file():
        return "no completion marker (the node died while writing it, or it was never finished)"
    try:
        m = json.loads(marker.read_text())
    except (OSError, ValueError) as exc:
        return f"unreadable completion marker: {exc}"
    if m.get("format") != CHECKPOINT_COMPLETE_FORMAT:
        return f"completion marker of another format: {m.get('format')!r}"
    if (m.get("step"), m.get("run_id"), m.get("world_size")) != (step, run_id, world_size):
        return (
            f"completion marker says step {m.get('step')}, run {m.get('run_id')!r}, world size "
            f"{m.get('world_size')}; expected {step}, {run_id!r}, {world_size}"
        )
    files = m.get("files") or {}
    need = {"training_state.pt", *(f"training_state_rank{r}.pt" for r in range(world_size))}
    if not need <= set(files):
        return f"completion marker lacks {sorted(need - set(files))}"
    for name, size in files.items():
        path = ckpt / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} has {path.stat().st_size} bytes, the marker recorded {size}"
    try:
        import torch

        # weights_only: a probe of every step directory must not run whatever a pickle names; SpecForge's shared
        # state is tensors, numbers, strings and containers of them, which this loader accepts
        state = torch.load(ckpt / "training_state.pt", map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # torch raises many unrelated types for a damaged file
        return f"training_state.pt does not load (weights_only): {type(exc).__name__}: {str(exc)[:300]}"
    if not isinstance(state, dict):
        return f"training_state.pt holds a {type(state).__name__}, not SpecForge's state dict"
    got = (state.get("global_step"), state.get("run_id"), state.get("world_size"))
    if got != (step, run_id, world_size):
        return f"training_state.pt holds step {got[0]}, run {got[1]!r}, world size {got[2]}"
    return None


def _step_dirs(out: Path, run_id: str) -> list[tuple[int, Path]]:
    pat = re.compile(rf"^{re.escape(run_id)}-step(\d+)$")
    found = []
    for p in Path(out).iterdir():
        m = pat.match(p.name)
        if m and p.is_dir() and not p.is_symlink():
            found.append((int(m.group(1)), p))
    return sorted(found)


# -- ledger ------------------------------------------------------------------------------------------------


def _ledger_rows(db: Path) -> tuple[list[str], set[str], dict]:
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        acked = [r[0] for r in con.execute("SELECT sample_id FROM acked ORDER BY rowid")]
        committed = {r[0] for r in con.execute("SELECT sample_id FROM committed")}
        marker = {k: json.loads(v) for k, v in con.execute("SELECT k, v FROM marker")}
    except sqlite3.DatabaseError as exc:
        raise KimiInputError(f"ledger {db} cannot be read: {exc}") from None
    finally:
        con.close()
    return acked, committed, marker


def reconcile(out: Path, *, run_id: str, quantum: int, world_size: int, ledger: Path) -> ResumePoint:
    """Decide the resume point from the ledger and the checkpoints on disk (reads only); raise
    :class:`KimiInputError` when they disagree."""
    steps = _step_dirs(out, run_id)
    if not ledger.is_file():
        if steps:
            raise KimiInputError(
                f"{out} has checkpoints ({steps[-1][1].name}, ...) but no ledger at {ledger}: which samples they "
                "hold cannot be told; restore the ledger or start a new run in another output_dir"
            )
        acked, committed, marker = [], set(), {}
    else:
        acked, committed, marker = _ledger_rows(ledger)
    m = int(marker.get("global_step") or 0)
    if m and not marker.get("optimizer_durable"):
        raise KimiInputError(f"ledger {ledger}: durable step {m} is not marked optimizer_durable; refusing to guess")
    if len(acked) != m * quantum:
        raise KimiInputError(
            f"ledger {ledger}: {len(acked)} acknowledged samples, but durable step {m} x {quantum} per step = "
            f"{m * quantum}; ledger and optimizer steps disagree"
        )
    never = [s for s in acked if s not in committed]
    if never:
        raise KimiInputError(
            f"ledger {ledger}: {len(never)} acknowledged samples were never committed, e.g. {never[0]}"
        )
    prefix = f"{run_id}:"
    odd = [s for s in committed if not (s.startswith(prefix) and _TASK_ID.match(s[len(prefix) :]))]
    if odd:
        raise KimiInputError(
            f"ledger {ledger}: sample id {odd[0]!r} does not name a prompt (expected {run_id}:epochEEEE-promptIIII...): "
            "the run started without deterministic prompt ids (a specforge-kimi older than its prompt-ids seam), so "
            "which prompts were trained "
            "cannot be told; start it again in a new output_dir"
        )
    incomplete: dict[str, str] = {}
    s, ckpt = 0, None
    # newest first: every directory past the ledger's step (a complete one there is a contradiction), then down
    # to the first complete one; older checkpoints are not read
    for step, path in reversed(steps):
        why = checkpoint_problem(path, run_id=run_id, step=step, world_size=world_size)
        if why is not None:
            incomplete[path.name] = why
        elif step > m:
            raise KimiInputError(
                f"checkpoint {path.name} is complete but the ledger's durable step is {m}: SpecForge acknowledges "
                "a step before checkpointing it, so ledger and checkpoint do not describe one run; refusing to guess"
            )
        else:
            s, ckpt = step, path
            break
    kept = tuple(acked[: s * quantum])
    return ResumePoint(
        step=s,
        checkpoint=ckpt,
        ledger_step=m,
        quantum=quantum,
        kept=kept,
        recaptured_acked=len(acked) - len(kept),
        in_flight=len(committed) - len(acked),
        abandoned=tuple(p for step, p in steps if step > s),
        incomplete=incomplete,
    )


def cut_ledger(ledger: Path, point: ResumePoint, backup: Path) -> None:
    """Back the ledger up, then in one transaction keep only the samples trained into ``point.step``. At step 0
    nothing is kept and the ledger goes away whole: SpecForge starts a consumer without ``resume_from`` only
    on a ledger path that does not exist (nor its ``-wal``/``-shm``)."""
    tmp = backup.with_name(f".{backup.name}.tmp")
    tmp.unlink(missing_ok=True)
    con = sqlite3.connect(ledger, isolation_level=None)  # explicit transactions only
    try:
        con.execute("VACUUM INTO ?", (str(tmp),))  # then fsync + rename: a backup is whole or absent
        fsync_path(tmp)
        os.replace(tmp, backup)
        fsync_path(backup.parent)
        if not point.step:
            con.close()
            for path in (ledger, Path(f"{ledger}-wal"), Path(f"{ledger}-shm")):
                path.unlink(missing_ok=True)
            return
        con.execute("BEGIN IMMEDIATE")
        con.execute(
            "DELETE FROM acked WHERE rowid NOT IN (SELECT rowid FROM acked ORDER BY rowid LIMIT ?)",
            (point.step * point.quantum,),
        )
        con.execute("DELETE FROM committed WHERE sample_id NOT IN (SELECT sample_id FROM acked)")
        con.execute("INSERT OR REPLACE INTO marker (k, v) VALUES ('global_step', ?)", (json.dumps(point.step),))
        con.execute("INSERT OR REPLACE INTO marker (k, v) VALUES ('optimizer_durable', 'true')")
        con.execute("COMMIT")
        con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    except BaseException:
        if con.in_transaction:
            con.execute("ROLLBACK")
        raise
    finally:
        con.close()


def ledger_backup_path(ledger: Path, k: int) -> Path:
    """A name no backup has: ``consumer.sqlite.before-attempt{k}``, or ``...-2``, ``-3`` when an interrupted
    ``--resume`` of attempt ``k`` already made one (that one is the ledger before any cut: never overwritten)."""
    backup = ledger.with_name(f"{ledger.name}.before-attempt{k}")
    n = 1
    while backup.exists():
        n += 1
        backup = ledger.with_name(f"{ledger.name}.before-attempt{k}-{n}")
    return backup


def _point_latest(out: Path, run_id: str, step: int) -> None:
    """``-latest`` -> step ``step`` (removed at 0), atomically; the directory fsynced after (with the renames
    of abandoned step directories before it)."""
    link = Path(out) / f"{run_id}-latest"
    if not step:
        if link.is_symlink():
            link.unlink()
    else:
        tmp = link.with_name(f".{link.name}.tmp")
        if tmp.is_symlink() or tmp.exists():
            tmp.unlink()
        tmp.symlink_to(f"{run_id}-step{step}")
        os.replace(tmp, link)
    fsync_path(out)


# -- attempts ----------------------------------------------------------------------------------------------


def attempt_paths(out: Path, k: int) -> dict[str, Path]:
    suffix = "" if k == 1 else f"-attempt{k}"
    return {
        "control": Path(out) / f"control{suffix}",
        "supervisor": Path(out) / f"supervisor{suffix}",
        "logs": Path(out) / f"logs{suffix}",
        "config": Path(out) / "rendered" / ("specforge_run.yaml" if k == 1 else f"specforge_run.attempt{k}.yaml"),
    }


def _base_config_path(plan) -> Path:
    for c in plan.commands:
        argv = list(c.argv)
        if "train" in argv and "-c" in argv[argv.index("train") : -1]:  # not the log wrapper's `sh -c`
            return Path(argv[argv.index("-c", argv.index("train")) + 1])
    raise KimiInputError("the plan has no SpecForge command with -c CONFIG")


def marked(plan, out: Path):
    """Every service and command of ``plan`` with the run's mark in its environment (:mod:`run_guard`)."""
    mark = {run_guard.RUN_DIR_ENV: str(Path(out).resolve())}
    cmd = dataclasses.replace
    return cmd(
        plan,
        services=tuple(cmd(s, command=cmd(s.command, env={**s.command.env, **mark})) for s in plan.services),
        commands=tuple(cmd(c, env={**c.env, **mark}) for c in plan.commands),
    )


def attempt_plan(plan, out: Path, k: int, *, point: ResumePoint, skip_file: Path):
    """``plan`` (attempt 1's, as :func:`launch.build_colocated_plan` builds it) for attempt ``k``: its own
    config (new control directory), logs and supervisor directories; the consumer resumed from
    ``point.checkpoint``; the producer leaving ``skip_file``'s prompts out, on a fresh channel."""
    import yaml

    cmd = dataclasses.replace
    paths = attempt_paths(out, k)
    base_cfg = _base_config_path(plan)
    cfg = yaml.safe_load(base_cfg.read_text())
    cfg["deployment"]["disaggregated"]["control_dir"] = str(paths["control"])
    write_atomic(paths["config"], yaml.safe_dump(cfg, sort_keys=False))
    logs = str(Path(plan.services[0].log_path).parent) if plan.services else str(Path(out) / "logs")

    def moved(a: str) -> str:
        if a == str(base_cfg):
            return str(paths["config"])
        return str(paths["logs"]) + a[len(logs) :] if a.startswith(logs + os.sep) else a

    env = {RESUME_SKIP_ENV: str(skip_file), FRESH_CHANNEL_ENV: "1"}
    commands = []
    for c in plan.commands:
        argv = [moved(a) for a in c.argv]
        if c.label == "consumer" and point.checkpoint is not None:
            argv.append(f"training.resume_from={point.checkpoint}")
        commands.append(cmd(c, argv=tuple(argv), env={**c.env, **env}))
    services = tuple(
        cmd(s, log_path=moved(s.log_path), command=cmd(s.command, argv=tuple(moved(a) for a in s.command.argv)))
        for s in plan.services
    )
    return cmd(plan, commands=tuple(commands), services=services, managed_root=str(paths["supervisor"]))


def begin_attempt(recipe, plan, *, resume: bool, stop_stale: bool = False, check=None, say=print):
    """Hold the run's lock, then either record attempt 1 (``resume=False``; a run directory that already
    holds an attempt is refused) or reconcile, cut back and prepare the next attempt (``resume=True``).
    ``check(plan)`` (the launch's machine preflight: ports, engines) runs on the attempt's plan before the
    run directory changes. Returns the plan to run, every process marked with the run directory."""
    import yaml

    out = Path(recipe.output_dir)
    if recipe.gpus.nnodes > 1:
        if resume:
            raise KimiInputError("--resume is single-node only (the ledger and the producer live on node 0)")
        if check is not None:
            check(plan)
        return plan
    run_guard.acquire_lock(out)
    record = read_record(out)
    base_cfg = yaml.safe_load(_base_config_path(plan).read_text())
    quantum = consumer_quantum(base_cfg)
    if not resume:
        return _first_attempt(recipe, plan, out, record, quantum, check)
    _check_resumable(recipe, out, record, quantum)
    stopped = _stop_previous_attempt(out, stop_stale, say)
    from specforge_kimi.run.ledger import ledger_db

    ledger = ledger_db(out)
    point = reconcile(out, run_id=recipe.name, quantum=quantum, world_size=recipe.tp, ledger=ledger)
    k = len(record.attempts) + 1
    paths = attempt_paths(out, k)
    for key in ("control", "supervisor", "logs"):
        if paths[key].exists():
            raise KimiInputError(f"{paths[key]} exists but {RECORD_FILE} records {k - 1} attempts; move it away")
    skip = out / "resume" / f"attempt{k}-trained-task-ids.txt"
    new_plan = attempt_plan(plan, out, k, point=point, skip_file=skip)
    if check is not None:
        check(new_plan)
    backup = _cut_back(out, recipe.name, point, k, ledger, skip)
    attempt = Attempt(
        attempt=k,
        started_utc=_utc(),
        config=str(paths["config"]),
        control_dir=str(paths["control"]),
        supervisor_dir=str(paths["supervisor"]),
        logs_dir=str(paths["logs"]),
        resumed_from_step=point.step,
        checkpoint=str(point.checkpoint) if point.checkpoint else None,
        ledger_step_before=point.ledger_step,
        trained_kept=len(point.kept),
        recaptured_acked=point.recaptured_acked,
        recaptured_in_flight=point.in_flight,
        abandoned=[f"{p.name}.abandoned-attempt{k}" for p in point.abandoned],
        incomplete=point.incomplete,
        stale_stopped=stopped,
        ledger_backup=str(backup) if backup else None,
        skip_file=str(skip),
    )
    record.attempts.append(attempt)
    write_record(out, record)
    say(
        f"resuming run {recipe.name}, attempt {k}: "
        + (f"from checkpoint step {point.step}" if point.step else "from the start (no complete checkpoint)")
        + f"; ledger durable step was {point.ledger_step}; {len(point.kept)} trained samples left out, "
        f"{point.recaptured_acked} acknowledged after the checkpoint and {point.in_flight} in flight captured again"
        + (f"; set aside: {', '.join(attempt.abandoned)}" if attempt.abandoned else "")
        + f"; logs in {paths['logs']}"
    )
    return marked(new_plan, out)


def _first_attempt(recipe, plan, out: Path, record, quantum: int, check):
    """Attempt 1 recorded (a run directory that already holds an attempt refused); the plan, marked."""
    first = attempt_paths(out, 1)
    if record is not None or first["supervisor"].exists():
        raise KimiInputError(
            f"{out} holds an earlier launch of run {recipe.name} ({first['supervisor']} exists); continue it "
            "from its last complete checkpoint with `specforge-kimi launch RECIPE --resume`, or move it away "
            "(or choose another output_dir) to start a new run"
        )
    if check is not None:
        check(plan)
    record = RunRecord(run_id=recipe.name, consumer_quantum=quantum)
    record.attempts.append(
        Attempt(
            attempt=1,
            started_utc=_utc(),
            config=str(first["config"]),
            control_dir=str(first["control"]),
            supervisor_dir=str(first["supervisor"]),
            logs_dir=str(first["logs"]),
        )
    )
    write_record(out, record)
    return marked(plan, out)


def _check_resumable(recipe, out: Path, record, quantum: int) -> None:
    """One line when the run directory holds no run of this recipe that can be resumed as it is."""
    if record is None:
        if not attempt_paths(out, 1)["supervisor"].exists():
            raise KimiInputError(f"{out} holds no launch of this run to resume; launch it without --resume")
        raise KimiInputError(
            f"{out} has no {RECORD_FILE}: it was launched before whole-run resume existed, with random "
            "sample ids, so which prompts were trained cannot be told; start it again in a new output_dir"
        )
    if record.run_id != recipe.name:
        raise KimiInputError(f"{out} holds run {record.run_id!r}, not the recipe's {recipe.name!r}")
    if quantum != record.consumer_quantum:
        raise KimiInputError(
            f"the recipe trains {quantum} samples per optimizer step, the run was started with "
            f"{record.consumer_quantum}: resume with the same GPUs, batch and accumulation"
        )


def _stop_previous_attempt(out: Path, stop_stale: bool, say) -> list[int]:
    """The previous attempt's processes still running: refused, or with ``stop_stale`` stopped (their pids)."""
    stale = run_guard.run_processes(out)
    if not stale:
        return []
    if not stop_stale:
        shown = "; ".join(f"{pid} {cmd[:80]}" for pid, cmd in stale[:5])
        raise KimiInputError(
            f"{len(stale)} processes of the previous attempt still run ({shown}{'; ...' if len(stale) > 5 else ''}); "
            "stop them, or add --stop-stale (SIGTERM, then SIGKILL after "
            f"{run_guard.STOP_GRACE_S:.0f} s)"
        )
    say(f"stopping {len(stale)} processes of the previous attempt: {[pid for pid, _ in stale]}")
    return run_guard.stop(stale)


def _cut_back(out: Path, run_id: str, point, k: int, ledger: Path, skip: Path) -> Path | None:
    """The run directory cut back to ``point`` for attempt ``k``: abandoned checkpoints set aside, ``latest``
    pointed at the checkpoint, the ledger cut (its backup returned) and the trained ids written to ``skip``.
    Each step is safe to repeat if --resume is interrupted."""
    for path in point.abandoned:
        path.rename(path.with_name(f"{path.name}.abandoned-attempt{k}"))
    _point_latest(out, run_id, point.step)
    backup = None
    if ledger.is_file():
        backup = ledger_backup_path(ledger, k)
        cut_ledger(ledger, point, backup)
    skip.parent.mkdir(exist_ok=True)
    write_atomic(skip, "".join(s.split(":", 1)[1] + "\n" for s in point.kept))
    return backup


#: how long an attempt's cleanup waits for the attempt's last processes to exit before it removes their files
SETTLE_S = 10.0

#: statuses of a launcher stopped on purpose (SpecForge's supervisor returns 128 + the signal it forwarded)
_STOPPED = {128 + 1, 128 + 2, 128 + 15}


def clean_leftovers(recipe, since: float) -> tuple[list[str], list[str]]:
    """What an attempt's killed processes left: the cuda_ipc pools of dead capture servers
    (``transport_plan.remove_stale_pools``; nothing for Mooncake) and the run's libraries' files in ``/dev/shm``
    since ``since`` (:mod:`shm_leftovers`; what live processes hold stays). The names removed, of each."""
    from specforge_kimi.plan.transport_plan import remove_stale_pools
    from specforge_kimi.run.shm_leftovers import remove_leftovers

    return remove_stale_pools(recipe), remove_leftovers(since)


def run_attempts(
    recipe, plan, run, *, resume: bool, stop_stale: bool = False, restarts: int = 0, check=None, say=print
) -> int:
    """:func:`begin_attempt` (with ``check``), then ``run(plan) -> status``; after a failed attempt, while ``restarts`` are
    left, the next one (``--resume``, stopping what the failed one left). No restart after a stop on purpose
    (SIGINT/TERM/HUP: status 129/130/143) nor after an attempt that made no durable step (it would fail the
    same way again). Around each ``run``, what cuda_ipc pools of killed capture servers left (pool files, slot
    tables) is removed (``transport_plan.remove_stale_pools``; nothing for Mooncake), and so is what the run's
    libraries left in ``/dev/shm`` since its first attempt (:mod:`shm_leftovers`), so every caller -- ``launch``,
    the drills -- starts and ends each attempt clean."""
    from specforge_kimi.run.ledger import durable_step

    def clean(since: float, *, settle_s: float = 0.0) -> None:
        deadline = time.monotonic() + settle_s  # a stopped server's schedulers may take a moment to go
        while settle_s and time.monotonic() < deadline and run_guard.run_processes(out):
            time.sleep(0.2)
        _pools, removed = clean_leftovers(recipe, since)
        if removed:
            say(f"removed {len(removed)} files the run's processes left in /dev/shm: {', '.join(removed[:4])}")

    out = Path(recipe.output_dir)
    current = begin_attempt(recipe, plan, resume=resume, stop_stale=stop_stale, check=check, say=say)
    used = 0
    while True:
        record = read_record(out)
        start = (record.attempts[-1].resumed_from_step or 0) if record else 0
        since = run_started(record)
        clean(since)
        try:
            rc = run(current)
        finally:
            clean(since, settle_s=SETTLE_S)
        if rc == 0 or used >= restarts or rc in _STOPPED:
            return rc
        reached = durable_step(out) or 0
        if reached <= start:
            say(f"attempt failed with status {rc} before any durable step past {start}; not restarting it")
            return rc
        used += 1
        say(f"attempt failed with status {rc} at durable step {reached}; whole-run restart {used}/{restarts}")
        current = begin_attempt(recipe, plan, resume=True, stop_stale=True, check=check, say=say)
