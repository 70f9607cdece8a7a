"""The live status line of an online run, read from SpecForge's files: step lines, ledger, refs, checkpoints.

The run directory here is laid out as SpecForge writes it (its own ledger class writes the ledger);
the same reader against a real CPU run: tests/integration/test_online_loop_cpu.py."""

from __future__ import annotations

import io
import json
import sqlite3
import time

import pytest
import yaml

from specforge_kimi.errors import KimiInputError
from specforge_kimi.run import ledger
from specforge_kimi.run.progress import LiveProgress, RunTail, consumer_steps, parse_step_line, status_line


def _line(step: int, loss: float, prefix: str = "", step_time: float = 0.5) -> str:
    m = {f"{prefix}acc_{i}": 0.5 - i / 10 for i in range(3)}
    m |= {f"{prefix}acceptance_rate_{i}": 0.7 - i / 10 for i in range(3)}
    m |= {f"{prefix}loss": loss, f"{prefix}perf/optimizer_step_time_s": step_time, f"{prefix}lr": 1e-4}
    return f"step {step}: {m}\n"


@pytest.fixture
def run_dir(tmp_path):
    run = tmp_path / "run"
    (run / "rendered").mkdir(parents=True)
    (run / "logs").mkdir()
    (run / "control").mkdir()
    cfg = {
        "run_id": "r",
        "output_dir": str(run),
        "training": {"max_steps": 100},
        "deployment": {"disaggregated": {"control_dir": str(run / "control")}},
    }
    (run / "rendered" / "specforge_run.yaml").write_text(yaml.safe_dump(cfg))
    return run


def _ledger(run, acked: list[str], tokens: dict[str, int], step: int) -> None:
    from specforge.runtime.control_plane.metadata_store import SQLiteMetadataStore

    (run / "consumer-state").mkdir(exist_ok=True)
    store = SQLiteMetadataStore(str(run / "consumer-state" / "consumer.sqlite"))
    try:
        with sqlite3.connect(store.path) as con:  # committed refs as SpecForge serializes them (JSON, num_tokens)
            con.executemany(
                "insert or ignore into committed (sample_id, ref_json) values (?, ?)",
                [(sid, json.dumps({"sample_id": sid, "num_tokens": n})) for sid, n in tokens.items()],
            )
        store.record_train_ack(acked, global_step=step, optimizer_durable=True)
    finally:
        store.close()


def test_step_lines_with_and_without_a_tracker():
    plain = parse_step_line(_line(10, 2.5).strip())
    tracked = parse_step_line(_line(10, 2.5, prefix="train/").strip())
    assert plain == tracked and plain["step"] == 10 and plain["loss"] == 2.5 and plain["acc_2"] == pytest.approx(0.3)
    assert parse_step_line("step 3: not a dict") is None and parse_step_line("loading weights") is None
    text = _line(1, 3.0) + "noise\n" + _line(2, 2.0) + _line(2, 2.1)  # a second rank's line for step 2
    assert [(r["step"], r["loss"]) for r in consumer_steps(text)] == [(1, 3.0), (2, 2.0)]


def test_ledger_counts_match_the_full_read(run_dir):
    assert ledger.counts(run_dir) == {"present": False}
    _ledger(run_dir, ["a", "b"], {"a": 100, "b": 50, "c": 70}, step=2)
    c, full = ledger.counts(run_dir), ledger.ledger(run_dir)
    assert c == {"present": True, "acked": 2, "committed": 3, "trained_tokens": 150, "global_step": 2}
    assert (c["acked"], c["committed"], c["trained_tokens"], c["global_step"]) == (
        full["acked"],
        full["committed"],
        full["trained_tokens"],
        full["global_step"],
    )


def test_snapshot_follows_the_files(run_dir):
    tail = RunTail(run_dir, ledger_every_s=0)
    snap = tail.poll()
    assert snap.step == 0 and snap.logged_step is None and snap.max_steps == 100
    assert "starting, no training step yet" in status_line(snap)

    log = run_dir / "logs" / "consumer-node0.log"
    log.write_text("loading ...\n" + _line(10, 3.0) + _line(20, 2.0, step_time=0.25) + "step 30: {'lo")
    (run_dir / "control" / "refs.jsonl").write_text('{"sample_id": "x"}\n' * 25)
    _ledger(run_dir, [f"s{i}" for i in range(20)], {f"s{i}": 40 for i in range(25)}, step=20)
    (run_dir / "r-step20").mkdir()
    (run_dir / "r-step20" / "training_state.pt").write_bytes(b"x")
    (run_dir / "r-step10").mkdir()  # no training_state.pt: not a checkpoint yet
    snap = tail.poll()
    assert (snap.step, snap.logged_step, snap.loss) == (20, 20, 2.0)
    assert snap.acceptance == pytest.approx([0.7, 0.6, 0.5]) and snap.accuracy == pytest.approx([0.5, 0.4, 0.3])
    assert snap.captured == 25 and snap.trained == 20 and snap.in_flight == 5 and snap.checkpoint == 20
    assert snap.tokens_per_step == 40 and snap.step_time_s == pytest.approx(0.375)
    assert snap.trained_tokens_per_s == pytest.approx(40 / 0.375) and snap.eta_s == pytest.approx(80 * 0.375)
    assert status_line(snap) == (
        "step 20/100 (20%) | loss 2.000 | accept 0.70 0.60 0.50 | 107 tok/s | in flight 5 | ckpt 20 | ETA 30s"
    )

    # the half-written line completes; the next poll reads only what was appended
    with open(log, "a") as f:
        f.write("ss': 9.9}\n" + _line(40, 1.5))
    snap = tail.poll()
    assert sorted(tail.steps) == [10, 20, 30, 40] and tail.steps[30]["loss"] == 9.9
    assert snap.loss == 1.5 and snap.step == 40
    (run_dir / "control" / "refs.jsonl.consumer_done").touch()
    snap = tail.poll()
    assert snap.finished and snap.eta_s is None and "finished: 20 samples trained" in status_line(snap)


def test_ledger_read_each_poll_until_a_durable_step(run_dir):
    """A long ledger interval still shows the first durable step at once (a short run's only chance of a
    rate); after that the ledger waits for its interval."""
    tail = RunTail(run_dir, ledger_every_s=3600)
    assert tail.poll().trained == 0  # no ledger yet
    _ledger(run_dir, [], {"a": 40}, step=0)
    assert tail.poll().tokens_per_step is None  # a ledger without a durable step: read again next poll
    _ledger(run_dir, ["a"], {"a": 40}, step=1)
    snap = tail.poll()
    assert snap.trained == 1 and snap.tokens_per_step == 40
    _ledger(run_dir, ["a", "b"], {"a": 40, "b": 40}, step=2)
    assert tail.poll().trained == 1  # durable step seen: the next read waits for the interval
    assert tail.poll(force_ledger=True).trained == 2


def test_not_a_run_directory(tmp_path):
    with pytest.raises(KimiInputError, match="not a launched run directory"):
        RunTail(tmp_path)


def _wait(done, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "the status thread wrote nothing"
        time.sleep(0.005)


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_live_progress_in_place_on_a_terminal(run_dir):
    (run_dir / "logs" / "consumer-node0.log").write_text(_line(5, 2.0))
    stream = _Tty()
    with LiveProgress(run_dir, stream=stream, interval_s=0.01) as live:
        _wait(lambda: live.lines >= 3)
    text = stream.getvalue()
    assert text.startswith("\rstep 5/100 (5%) | loss 2.000") and text.endswith("\x1b[K\n")
    assert text.count("\n") == 1  # one line, rewritten in place, ended once


def test_live_progress_plain_lines_only_on_change(run_dir):
    stream = io.StringIO()
    with LiveProgress(run_dir, stream=stream, interval_s=0.01) as live:
        _wait(lambda: live.lines >= 1)
        (run_dir / "logs" / "consumer-node0.log").write_text(_line(5, 2.0))
        _wait(lambda: live.lines >= 2)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2 and "starting" in lines[0] and lines[1].startswith("step 5/100")
