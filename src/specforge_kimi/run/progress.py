"""Live progress of an online run, read from what SpecForge already writes into its output directory.

Scope: a run directory written by ``specforge-kimi launch``. Nothing here adds a metrics path; the
sources are SpecForge's own: the consumer log's ``step N: {...}`` lines (rank 0's console metrics,
every ``training.log_interval`` steps; keys plain, or ``train/...`` when a tracker is on), its
consumer ledger (:func:`ledger.counts`: durable step, trained samples and their tokens), the
producer's ``refs.jsonl`` in the control directory (one line per captured sample) and the checkpoint
directories ``<run_id>-step<N>``. Read incrementally (:class:`RunTail` keeps file offsets), so a
poll of a long run costs a few reads. One status line (:func:`status_line`): step / max_steps,
loss, per-position acceptance (SpecForge's ``acceptance_rate_i``, else its top-1 ``acc_i``),
trained tokens per second (tokens per step from the ledger over SpecForge's measured step time),
captures in flight (captured, not yet trained), newest checkpoint, ETA. ``launch`` refreshes it in
place on a terminal and prints it periodically otherwise (:class:`LiveProgress`);
``specforge-kimi watch OUTPUT_DIR`` shows the same for a run started elsewhere or in the background.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TextIO

from specforge_kimi.errors import KimiInputError
from specforge_kimi.run.periodic import Periodic

_STEP = re.compile(r"^step (\d+): (\{.*\})\s*$", re.M)


def parse_step_line(line: str) -> dict | None:
    """``{"step": N, **metrics}`` from one of SpecForge's console lines (``step N: {...}``), else None.
    Metric keys lose the ``train/`` prefix SpecForge's trackers add, so runs with and without
    ``tracking`` read the same."""
    m = _STEP.match(line.strip())
    if not m:
        return None
    try:
        metrics = ast.literal_eval(m.group(2))
    except (ValueError, SyntaxError):
        return None
    if not isinstance(metrics, dict):
        return None
    out: dict = {"step": int(m.group(1))}
    for k, v in metrics.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out[str(k).removeprefix("train/")] = float(v)
    return out


def consumer_steps(log_text: str) -> list[dict]:
    """``[{"step": N, **metrics}]`` from SpecForge's console lines, one per step (rank 0's, also if
    several ranks print)."""
    out, seen = [], set()
    for m in _STEP.finditer(log_text):
        row = parse_step_line(m.group(0))
        if row is None or row["step"] in seen:
            continue
        seen.add(row["step"])
        out.append(row)
    return out


class StepLines:
    """A line callback (:func:`console.output_to_log`'s ``on_line``) that moves a :class:`console.Progress`
    bar by SpecForge's own ``step N: {...}`` lines as they are printed, with their loss as the postfix."""

    def __init__(self, bar=None) -> None:
        self.bar = bar

    def __call__(self, line: str) -> None:
        row = parse_step_line(line) if self.bar is not None else None
        if row is not None and "loss" in row:
            self.bar.set(row["step"], loss=f"{row['loss']:.3f}")


def per_position(row: dict, stem: str) -> list[float]:
    """``row[f"{stem}_0"], row[f"{stem}_1"], ...`` (SpecForge's per-TTT-position metrics)."""
    out, i = [], 0
    while f"{stem}_{i}" in row:
        out.append(row[f"{stem}_{i}"])
        i += 1
    return out


@dataclass
class Snapshot:
    """What a run directory says now (every field ``None`` / empty until its source exists)."""

    run_dir: str
    run_id: str
    max_steps: int | None
    step: int = 0  # the newer of the last logged step and the ledger's durable step
    logged_step: int | None = None  # the step the metrics below are from
    loss: float | None = None
    acceptance: list[float] = field(default_factory=list)  # SpecForge's acceptance_rate_i
    accuracy: list[float] = field(default_factory=list)  # SpecForge's acc_i (top-1 agreement)
    step_time_s: float | None = None  # median of SpecForge's perf/optimizer_step_time_s, last 5 logged
    tokens_per_step: float | None = None  # ledger: trained tokens / durable step
    trained_tokens_per_s: float | None = None
    captured: int = 0  # refs the producer published
    trained: int = 0  # samples the ledger acked
    in_flight: int = 0  # captured, not yet trained
    checkpoint: int | None = None  # newest <run_id>-step<N> with a training_state.pt
    eta_s: float | None = None
    finished: bool = False  # SpecForge's consumer_done marker
    log_age_s: float | None = None  # seconds since the consumer log last changed

    def to_json(self) -> dict:
        return asdict(self)


class RunTail:
    """Follows one run directory; :meth:`poll` returns a fresh :class:`Snapshot`. Logs and refs are read
    from where the last poll stopped; the ledger on every poll until it holds a durable step, then at most
    every ``ledger_every_s``."""

    def __init__(self, run_dir: str | Path, *, ledger_every_s: float = 10.0) -> None:
        import yaml

        self.run = Path(run_dir)
        cfg_path = self.run / "rendered" / "specforge_run.yaml"
        if not cfg_path.is_file():
            raise KimiInputError(
                f"{self.run} is not a launched run directory (no rendered/specforge_run.yaml); "
                "pass the recipe's output_dir"
            )
        cfg = yaml.safe_load(cfg_path.read_text()) or {}
        self.run_id = cfg.get("run_id", "")
        self.max_steps = (cfg.get("training") or {}).get("max_steps")
        control = ((cfg.get("deployment") or {}).get("disaggregated") or {}).get("control_dir")
        self.control = Path(control) if control and Path(control).is_dir() else self.run / "control"
        self.ledger_every_s = ledger_every_s
        self._offsets: dict[Path, int] = {}
        self._partial: dict[Path, bytes] = {}
        self.steps: dict[int, dict] = {}
        self._refs_offset = 0
        self._refs_path: Path | None = None
        self.captured = 0
        self._ledger: dict = {"present": False}
        self._ledger_at = float("-inf")

    def _new_bytes(self, path: Path, offset: int) -> tuple[bytes, int]:
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return b"", 0
        if size < offset:  # truncated or replaced: read again from the start
            offset = 0
        if size == offset:
            return b"", offset
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read(size - offset)
        return data, offset + len(data)

    def _consumer_logs(self) -> list[Path]:
        """Every attempt's consumer logs, oldest attempt first (``logs/``, then ``launch --resume``'s
        ``logs-attempt2/``, ...): a step a later attempt trained again is the later one's."""
        dirs = [self.run / "logs"] + sorted(
            self.run.glob("logs-attempt*"), key=lambda d: int(d.name.rsplit("attempt", 1)[1] or 0)
        )
        return [log for d in dirs for log in sorted(d.glob("consumer-node*.log"))]

    def _control(self) -> Path:
        """The newest attempt's control directory (its refs.jsonl is the current producer's)."""
        attempts = sorted(self.run.glob("control-attempt*"), key=lambda d: int(d.name.rsplit("attempt", 1)[1] or 0))
        return attempts[-1] if attempts else self.control

    def _read_logs(self) -> None:
        for log in self._consumer_logs():
            data, self._offsets[log] = self._new_bytes(log, self._offsets.get(log, 0))
            if not data:
                continue
            data = self._partial.pop(log, b"") + data
            *lines, rest = data.split(b"\n")
            self._partial[log] = rest
            for line in lines:
                row = parse_step_line(line.decode("utf-8", "replace"))
                if row is not None:
                    self.steps[row["step"]] = row

    def _read_refs(self) -> None:
        refs = self._control() / "refs.jsonl"
        if self._refs_path is not None and refs != self._refs_path:  # a new attempt: its own channel
            self._refs_offset, self.captured = 0, 0
        self._refs_path = refs
        data, self._refs_offset = self._new_bytes(refs, self._refs_offset)
        self.captured += data.count(b"\n")

    def _newest_checkpoint(self) -> int | None:
        found = [
            int(p.name.rsplit("step", 1)[1])
            for p in self.run.glob(f"{self.run_id}-step*")
            if p.name.rsplit("step", 1)[1].isdigit() and (p / "training_state.pt").is_file()
        ]
        return max(found) if found else None

    def poll(self, *, force_ledger: bool = False) -> Snapshot:
        from specforge_kimi.run.ledger import counts

        self._read_logs()
        self._read_refs()
        now = time.monotonic()
        # until the ledger holds a durable step (tokens per step, hence tok/s, come from it) it is read on
        # every poll: a short run would otherwise finish between two reads without ever showing a rate
        no_durable_step = not self._ledger.get("global_step")
        if force_ledger or no_durable_step or now - self._ledger_at >= self.ledger_every_s:
            self._ledger, self._ledger_at = counts(self.run), now
        led = self._ledger
        snap = Snapshot(str(self.run), self.run_id, self.max_steps, captured=self.captured)
        logs = self._consumer_logs()
        if logs:
            snap.log_age_s = max(0.0, time.time() - max(p.stat().st_mtime for p in logs))
        if self.steps:
            last = self.steps[max(self.steps)]
            snap.logged_step = last["step"]
            snap.loss = last.get("loss")
            snap.acceptance = per_position(last, "acceptance_rate")
            snap.accuracy = per_position(last, "acc")
            recent = [
                r["perf/optimizer_step_time_s"]
                for r in (self.steps[k] for k in sorted(self.steps)[-5:])
                if "perf/optimizer_step_time_s" in r
            ]
            snap.step_time_s = statistics.median(recent) if recent else None
        durable = led.get("global_step", 0) if led.get("present") else 0
        snap.step = max(snap.logged_step or 0, durable)
        if led.get("present"):
            snap.trained = led["acked"]
            if durable:
                snap.tokens_per_step = led["trained_tokens"] / durable
        snap.in_flight = max(0, snap.captured - snap.trained)
        if snap.tokens_per_step and snap.step_time_s:
            snap.trained_tokens_per_s = snap.tokens_per_step / snap.step_time_s
        snap.checkpoint = self._newest_checkpoint()
        snap.finished = (self.control / "refs.jsonl.consumer_done").exists()
        if snap.step_time_s and self.max_steps and not snap.finished:
            snap.eta_s = max(0, self.max_steps - snap.step) * snap.step_time_s
        return snap


def _duration(seconds: float) -> str:
    s = int(round(seconds))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def _count(x: float) -> str:
    return f"{x / 1e6:.1f}M" if x >= 1e6 else f"{x / 1e3:.1f}k" if x >= 1e3 else f"{x:.0f}"


def status_line(snap: Snapshot) -> str:
    """One line for a console: ``step 230/600 (38%) | loss 2.897 | accept 0.69 0.66 0.65 0.65 | 5.1k
    tok/s | in flight 12 | ckpt 200 | ETA 2m05s``."""
    if snap.logged_step is None and not snap.step:
        what = "finished without a logged step" if snap.finished else "starting, no training step yet"
        return (
            f"{snap.run_id}: {what}; {snap.captured} samples captured "
            f"(the capture server loads the target first: {snap.run_dir}/logs/capture-server-node0.log)"
        )
    parts = [f"step {snap.step}/{snap.max_steps}" + (f" ({snap.step / snap.max_steps:.0%})" if snap.max_steps else "")]
    if snap.loss is not None:
        parts.append(f"loss {snap.loss:.3f}")
    if snap.acceptance:
        parts.append("accept " + " ".join(f"{a:.2f}" for a in snap.acceptance))
    elif snap.accuracy:
        parts.append("acc " + " ".join(f"{a:.2f}" for a in snap.accuracy))
    if snap.trained_tokens_per_s:
        parts.append(f"{_count(snap.trained_tokens_per_s)} tok/s")
    parts.append(f"in flight {snap.in_flight}")
    if snap.checkpoint is not None:
        parts.append(f"ckpt {snap.checkpoint}")
    if snap.finished:
        parts.append(f"finished: {snap.trained} samples trained")
    elif snap.eta_s is not None:
        parts.append(f"ETA {_duration(snap.eta_s)}")
    if not snap.finished and snap.log_age_s is not None and snap.log_age_s > 300:
        parts.append(f"consumer log quiet for {_duration(snap.log_age_s)}")
    return " | ".join(parts)


class LiveProgress:
    """A background thread showing :func:`status_line` of ``run_dir`` every ``interval_s``: rewritten in
    place on a terminal, one line per change otherwise. Use as a context manager around the run."""

    def __init__(self, run_dir: str | Path, *, stream: TextIO | None = None, interval_s: float | None = None) -> None:
        from specforge_kimi.console import is_terminal

        self.run_dir = Path(run_dir)
        self.stream = sys.stderr if stream is None else stream
        self.tty = is_terminal(self.stream)
        self.interval_s = interval_s if interval_s is not None else (2.0 if self.tty else 60.0)
        self._periodic: Periodic | None = None
        self._tail: RunTail | None = None
        self._last = ""
        self.lines = 0

    def show(self, line: str, *, final: bool = False) -> None:
        """Write ``line``: in place on a terminal (``final`` ends it with a newline); otherwise as a new
        line, unless it says what the last one did."""
        if self.tty:
            self.stream.write("\r" + line + "\x1b[K" + ("\n" if final else ""))
        elif line != self._last:
            self.stream.write(line + "\n")
        else:
            return
        self.stream.flush()
        self._last = line
        self.lines += 1

    def _tick(self, *, final: bool = False) -> None:
        if self._tail is None:
            try:
                self._tail = RunTail(self.run_dir)
            except KimiInputError:
                return
        self.show(status_line(self._tail.poll(force_ledger=final)), final=final)

    def _safe_tick(self) -> None:
        try:
            self._tick()
        except Exception as exc:  # a status line must never stop the run it reports on
            self.show(f"(progress unavailable: {exc})")

    def __enter__(self) -> LiveProgress:
        self._periodic = Periodic(self._safe_tick, self.interval_s, name="specforge-kimi-progress").start()
        return self

    def __exit__(self, *exc) -> None:
        if self._periodic is not None:
            self._periodic.stop()
        try:
            self._tick(final=True)
        except Exception as e:  # the run's own result matters more than its last status line
            self.show(f"(progress unavailable: {e})", final=True)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``watch`` command's arguments (``specforge_kimi.cli.COMMANDS`` declares the command)."""
    p.description = (
        "Follows OUTPUT_DIR (a recipe's output_dir) from what SpecForge writes there: its "
        "consumer log, ledger, refs and checkpoints. Ends when SpecForge marks the consumer done, or on Ctrl-C."
    )
    p.add_argument("output_dir", help="the recipe's output_dir (what `specforge-kimi launch` writes)")
    p.add_argument(
        "--interval",
        type=float,
        default=None,
        metavar="SECONDS",
        help="seconds between refreshes (default: 2 on a terminal, 60 otherwise)",
    )
    p.add_argument("--once", action="store_true", help="print the status once and exit")
    p.add_argument("--json", action="store_true", help="with --once: the whole snapshot as JSON")


def run(args: argparse.Namespace) -> int:
    tail = RunTail(args.output_dir)
    if args.once:
        snap = tail.poll(force_ledger=True)
        print(json.dumps(snap.to_json(), indent=2) if args.json else status_line(snap), flush=True)
        return 0
    live = LiveProgress(args.output_dir, stream=sys.stdout, interval_s=args.interval)
    while True:
        snap = tail.poll()
        if snap.finished:
            live.show(status_line(tail.poll(force_ledger=True)), final=True)
            return 0
        live.show(status_line(snap))
        time.sleep(live.interval_s)
