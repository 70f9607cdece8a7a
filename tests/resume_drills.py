"""Whole-run resume drills, shared by the CPU drills (``tests/integration/test_resume_cpu.py``) and the GPU ones
(``tests/gpu/test_resume_gpu.py``): launch a run (``tests/resume_attempt.py``, its own session), SIGKILL the
launcher's process group and every process group it started at a chosen point, then launch it again with
``--resume``; read the outcome back from the run's attempt record (``resume.json``), SpecForge's ledger and
the consumer logs.

Kill points (``kind``):
- ``before``: right after the consumer logged optimizer step ``k`` (durable in the ledger), ``k`` not a
  checkpoint step -- the samples of the steps since the last checkpoint are lost and must be captured again;
- ``after``: right after checkpoint ``k``'s completion marker appeared -- nothing is lost;
- ``during``: while checkpoint ``k`` is being written (``resume_drill_consumer`` pauses the write at a
  random phase; the kill is ours) -- checkpoint ``k`` must not be loaded, the previous one is.
Only process groups are killed: torchrun's ranks (sessions of their own) outlive it, as on a real
``kill -9`` of a launch; the next attempt finds and stops them (``run_guard``, ``--stop-stale``).
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ATTEMPT_TIMEOUT_S = 600.0
PHASES = ("rank-file", "shared-file", "marker")


def _consumer_log(out: Path, attempt: int) -> Path:
    return out / ("logs" if attempt == 1 else f"logs-attempt{attempt}") / "consumer-node0.log"


def steps_logged(text: str) -> dict[int, dict]:
    """``{step: metrics}`` from SpecForge's ``step N: {...}`` console lines (the first intact one of each step).
    With two ranks both print each line into one log, and their writes can interleave mid-line: the pattern
    is not anchored to lines, and a dict cut by the other rank's line does not match (no brace inside).
    Keys are given without the tracker's ``train/`` prefix (SpecForge adds it when a tracker such as
    TensorBoard, the recipes' default, is on), so ``lr`` and ``loss`` read the same either way."""
    from specforge_kimi.run.progress import parse_step_line

    out: dict[int, dict] = {}
    for m in re.finditer(r"step \d+: \{[^{}]*\}", text):
        row = parse_step_line(m.group(0))  # the console-line reader `launch` and `watch` use
        if row is not None and row["step"] not in out:
            out[row.pop("step")] = row
    return out


def _flag_step(flag: Path) -> int | None:
    """The step of the checkpoint write holding still, from the drill flag (``STEP PHASE PID``, written whole by
    ``resume_drill_consumer``); None while there is none."""
    try:
        fields = flag.read_text().split()
    except OSError:
        return None
    return int(fields[0]) if fields and fields[0].isdigit() else None


class Run:
    """One run directory driven through attempts; ``settings`` go to ``tests/resume_attempt.py``."""

    def __init__(self, root: Path, settings: dict, *, seed: int):
        self.root = Path(root)
        self.out = self.root / "run"
        self.settings = {
            "root": str(self.root),
            "events": str(self.root / "events.jsonl"),
            "pids": str(self.root / "pids.txt"),
            "flag": str(self.root / "drill-flag"),
            **settings,
        }
        self.rng = random.Random(seed)
        self.seed = seed
        self.attempts = 0
        self.kills: list[dict] = []
        self.first_step_at: dict[int, float] = {}  # attempt -> wall-clock time its consumer first logged a step

    @property
    def run_id(self) -> str:
        return json.loads((self.out / "resume.json").read_text())["run_id"]

    def _start(self, *, resume: bool, slow_save: str | None = None) -> subprocess.Popen:
        self.attempts += 1
        Path(self.settings["pids"]).write_text("")
        flag = Path(self.settings["flag"])
        if flag.exists():
            flag.unlink()
        cfg = self.root / f"attempt{self.attempts}.json"
        cfg.write_text(json.dumps({**self.settings, "resume": resume, "slow_save": slow_save}))
        log = open(self.root / f"attempt{self.attempts}.log", "wb")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        return subprocess.Popen(
            [sys.executable, str(TESTS / "resume_attempt.py"), str(cfg)],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
        )

    def _kill_all(self, proc: subprocess.Popen) -> list[int]:
        groups = [proc.pid] + [int(x) for x in Path(self.settings["pids"]).read_text().split()]
        for pgid in groups:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()
        return groups

    def _note_first_step(self, attempt: int) -> None:
        if attempt not in self.first_step_at and steps_logged(self._attempt_text(attempt)):
            self.first_step_at[attempt] = time.time()

    def _attempt_text(self, attempt: int) -> str:
        path = _consumer_log(self.out, attempt)
        return path.read_text(errors="replace") if path.is_file() else ""

    def _log_tail(self) -> str:
        path = self.root / f"attempt{self.attempts}.log"
        return path.read_text(errors="replace")[-3000:] if path.is_file() else ""

    def kill_at(self, kind: str, step: int | None = None, *, resume: bool, nth_save: int | None = None) -> dict:
        """Start an attempt, SIGKILL everything at ``kind``/``step``; returns what happened. ``during`` may name
        ``nth_save`` instead of ``step``: the attempt's n-th checkpoint write, whatever its step (recorded from the
        flag the write touches) -- the checkpoint a resumed attempt starts from is known only once it has started,
        because ranks of the killed attempt (sessions of their own) go on training and saving until the next
        launch stops them (one H200, 2026-12-04: killed after step 2x, they reached step 79 and checkpoint 60)."""
        if (step is None) == (nth_save is None) or (nth_save is not None and (kind != "during" or nth_save < 1)):
            raise ValueError(f"kill_at: one of step, nth_save (>= 1, only for during), got {step=} {nth_save=}")
        if resume and step is not None and step <= self.resume_point():  # a resumed attempt saves only past it
            raise AssertionError(
                f"{kind} step {step} cannot be reached: the resumed run starts after checkpoint {self.resume_point()}"
            )
        phase = self.rng.choice(PHASES) if kind == "during" else None
        hold = f"+{nth_save}" if nth_save is not None else step
        proc = self._start(resume=resume, slow_save=f"{hold}:{phase}:120" if phase else None)
        attempt = self.attempts
        ckpt = None
        deadline = time.monotonic() + ATTEMPT_TIMEOUT_S
        hit = False
        while time.monotonic() < deadline and proc.poll() is None:
            self._note_first_step(attempt)
            if kind == "before":
                hit = step in steps_logged(self._attempt_text(attempt))
            elif kind == "after":
                ckpt = self._checkpoint_dir(step)
                hit = ckpt is not None and (ckpt / "specforge_kimi_complete.json").is_file()
            else:
                hit = _flag_step(Path(self.settings["flag"])) is not None
            if hit:
                break
            time.sleep(0.05)
        killed_at = time.time()
        if not hit:
            self._kill_all(proc)
            aim = f"checkpoint write {nth_save}" if nth_save is not None else f"step {step}"
            raise AssertionError(f"attempt {attempt} never reached {kind} {aim}: {self._log_tail()}")
        groups = self._kill_all(proc)
        if nth_save is not None:
            step = _flag_step(Path(self.settings["flag"]))
        event = {
            "attempt": attempt,
            "kind": kind,
            "step": step,
            "phase": phase,
            "killed_at": killed_at,
            "groups_killed": len(groups),
        }
        self.kills.append(event)
        return event

    def resume_point(self) -> int:
        """The newest complete checkpoint's step (0 without one): where the next ``--resume`` starts training."""
        try:
            run_id = self.run_id
        except (OSError, ValueError, KeyError):
            return 0
        steps = [
            int(p.name.rsplit("step", 1)[1])
            for p in self.out.glob(f"{run_id}-step*")
            if p.name.rsplit("step", 1)[1].isdigit() and (p / "specforge_kimi_complete.json").is_file()
        ]
        return max(steps, default=0)

    def _checkpoint_dir(self, step: int) -> Path | None:
        try:
            return self.out / f"{self.run_id}-step{step}"
        except (OSError, ValueError, KeyError):
            return None

    def finish(self, *, resume: bool = True) -> int:
        """Start an attempt and let it run to the end; its status."""
        proc = self._start(resume=resume)
        return self.wait(proc)

    def wait(self, proc: subprocess.Popen, timeout: float = 2 * ATTEMPT_TIMEOUT_S) -> int:
        """Wait for the launcher ``proc``, noting when each attempt's consumer logs its first step."""
        deadline = time.monotonic() + timeout
        while proc.poll() is None:
            if time.monotonic() > deadline:
                self._kill_all(proc)
                raise AssertionError(f"attempt {self.attempts} did not finish: {self._log_tail()}")
            for attempt in range(self.attempts, self.attempts + 3):  # the launcher's own restarts add attempts
                self._note_first_step(attempt)
            time.sleep(0.1)
        return proc.returncode

    def start(self, *, resume: bool) -> subprocess.Popen:
        return self._start(resume=resume)

    def record(self) -> dict:
        return json.loads((self.out / "resume.json").read_text())

    def events(self) -> list[dict]:
        path = Path(self.settings["events"])
        return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []

    def restarts(self) -> int:
        """Whole-run restarts the launcher made by itself (``resilience.run_restarts``)."""
        return sum(1 for e in self.events() if e.get("event") == "say" and "whole-run restart" in e["text"])


def final_ledger(out: Path) -> dict:
    """Acknowledged sample ids in rowid order, the durable step and committed count, from SpecForge's ledger."""
    import sqlite3

    from specforge_kimi.run.ledger import ledger_db

    con = sqlite3.connect(f"file:{ledger_db(out)}?mode=ro", uri=True)
    try:
        acked = [r[0] for r in con.execute("SELECT sample_id FROM acked ORDER BY rowid")]
        committed = con.execute("SELECT COUNT(*) FROM committed").fetchone()[0]
        marker = dict(con.execute("SELECT k, v FROM marker"))
    finally:
        con.close()
    return {"acked": acked, "committed": committed, "global_step": int(json.loads(marker.get("global_step", "0")))}


def backup_acked(path: Path) -> list[str]:
    import sqlite3

    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return [r[0] for r in con.execute("SELECT sample_id FROM acked ORDER BY rowid")]
    finally:
        con.close()


def run_processes(out: Path) -> list[tuple[int, str]]:
    from specforge_kimi.run.run_guard import run_processes as found

    return found(out)


def check_run(run: Run, *, prompts: int, quantum: int, save_interval: int) -> dict:
    """The drill's checks, from the record, the ledger and the logs; returns the numbers they rest on.

    - every prompt of the epoch trained exactly once: the final ledger acknowledges each prompt's id once,
      ``prompts`` ids in all, ``global_step x Q`` of them;
    - each resumed attempt started from the newest complete checkpoint the kill left: the last multiple of
      ``save_interval`` at or below the ledger's durable step M, or the one before it when the kill landed
      while checkpoint M was being written (always so for ``during``; ``after`` resumes from its step) --
      a step directory past S is set aside (``*.abandoned-attempt<k>``) as incomplete, never loaded;
    - the counts add up: trained_kept = S x Q, recaptured = (M - S) x Q, and the samples left out are the
      first S x Q acknowledged rows of the ledger before the cut;
    - the loss curve continues from the checkpoint: attempt k+1 logs steps S+1, S+2, ... (none at or below
      S), at the learning rate the schedule gives (equal to what attempt k logged at those steps, if it got
      there), and where attempt k+1 trained the very samples attempt k had at step S+1, the same loss;
    - no process of the run is left, nor what its processes left in ``/dev/shm`` (``run.shm_leftovers``).
    """
    rec = run.record()
    led = final_ledger(run.out)
    run_id = rec["run_id"]
    expected = {f"{run_id}:epoch0000-prompt{i:012d}" for i in range(prompts)}
    assert len(led["acked"]) == len(set(led["acked"])) == prompts == led["global_step"] * quantum, (
        len(led["acked"]),
        len(set(led["acked"])),
        prompts,
        led["global_step"],
    )
    assert set(led["acked"]) == expected
    attempts = rec["attempts"]
    assert len(attempts) == len(run.kills) + 1 + run.restarts(), (len(attempts), run.kills)
    numbers = []
    same_sample_checks = 0
    for prev, cur in zip(attempts, attempts[1:], strict=False):
        k = cur["attempt"]
        s, m = cur["resumed_from_step"], cur["ledger_step_before"]
        kill = next((e for e in run.kills if e["attempt"] == prev["attempt"]), None)
        # checkpoints between S and M were not complete: at most one, the one being written at step M (its
        # directory may not exist yet); whatever step directory lies past S was set aside as incomplete
        passed = [c for c in range(save_interval, m + 1, save_interval) if c > s]
        assert passed in ([], [m]), (s, m, passed)
        assert all(a.split(".abandoned-attempt")[0] in cur["incomplete"] for a in cur["abandoned"]), cur
        assert all(int(a.split("-step")[1].split(".")[0]) > s for a in cur["abandoned"]), cur
        if kill is not None:
            assert m >= kill["step"], (kill, cur)
            if kill["kind"] == "during":
                assert m == kill["step"] and passed == [m], (kill, cur)
                assert f"{run_id}-step{m}.abandoned-attempt{k}" in cur["abandoned"], cur
                assert (run.out / f"{run_id}-step{m}.abandoned-attempt{k}").is_dir()
            if kill["kind"] == "after":
                assert s == kill["step"], (kill, cur)
        assert cur["trained_kept"] == s * quantum and cur["recaptured_acked"] == (m - s) * quantum, cur
        before = backup_acked(Path(cur["ledger_backup"]))
        assert len(before) == m * quantum
        skipped = Path(cur["skip_file"]).read_text().split()
        assert skipped == [x.split(":", 1)[1] for x in before[: s * quantum]]
        assert led["acked"][: s * quantum] == before[: s * quantum]  # what the checkpoint holds stays trained
        resumed = steps_logged(run._attempt_text(k))
        earlier = steps_logged(run._attempt_text(prev["attempt"]))
        assert resumed and min(resumed) == s + 1, (s, sorted(resumed)[:3])
        for step in sorted(set(resumed) & set(earlier)):
            if step > m:
                break
            assert resumed[step]["lr"] == earlier[step]["lr"], (step, resumed[step]["lr"], earlier[step]["lr"])
        window = slice(s * quantum, (s + 1) * quantum)
        if s + 1 in earlier and sorted(before[window]) == sorted(led["acked"][window]):
            a, b = resumed[s + 1]["loss"], earlier[s + 1]["loss"]
            assert abs(a - b) <= 1e-4 * max(1.0, abs(b)), (s + 1, a, b)
            same_sample_checks += 1
        numbers.append(
            {
                "attempt": k,
                "after_kill": kill,
                "resumed_from_step": s,
                "ledger_step_before": m,
                "trained_kept": cur["trained_kept"],
                "recaptured_acked": cur["recaptured_acked"],
                "recaptured_in_flight": cur["recaptured_in_flight"],
                "abandoned": cur["abandoned"],
                "stale_stopped": len(cur["stale_stopped"]),
                "time_to_first_resumed_step_s": (
                    round(run.first_step_at[k] - kill["killed_at"], 1)
                    if kill is not None and k in run.first_step_at
                    else None
                ),
            }
        )
    left = run_processes(run.out)
    assert not left, left
    # what the run's processes left in /dev/shm (SGLang's load snapshot, torch's and CUDA's IPC files) was removed
    # by the last attempt's cleanup (resume.run_attempts)
    from specforge_kimi.run.resume import read_record, run_started
    from specforge_kimi.run.shm_leftovers import matching

    shm_left = matching(run_started(read_record(run.out)))  # held or not: no process of the run is left (above)
    assert not shm_left, shm_left
    return {
        "seed": run.seed,
        "prompts": prompts,
        "acked": len(led["acked"]),
        "duplicates": len(led["acked"]) - len(set(led["acked"])),
        "lost": len(expected - set(led["acked"])),
        "global_step": led["global_step"],
        "attempts": numbers,
        "same_sample_loss_checks": same_sample_checks,
    }
