"""Keep one role of a co-located run alive: restart a lost capture server, resume a crashed consumer.

Scope: a wrapper process between SpecForge's supervisor (``launch_plan.run_commands``, which
stops the whole run when any service or command exits) and one role's command. It stays in the
role's process group, so the supervisor's SIGTERM/SIGKILL of the group reaches the child too; on
such a signal it stops restarting and exits with the child.

- ``--restarts N`` (service mode): rerun the command when it exits, at most ``N`` times, after
  ``--backoff`` seconds. For the capture server: the producer waits for it meanwhile
  (``registration``'s ``outage-wait`` seam) and the features already committed survive in the
  Mooncake segment when a separate segment owner holds them (:mod:`segment_keeper`).
- ``--resume-consumer RUN_DIR RUN_ID --restarts N`` (consumer mode): when the torchrun consumer
  exits non-zero, rerun it with ``training.resume_from=RUN_DIR/RUN_ID-latest`` -- SpecForge's own
  consumer-only online resume, which needs the producer, channel and Mooncake objects alive (they
  are: only the consumer died) and refuses unless the ledger's durable step equals the
  checkpoint's. That condition is checked first; when it does not hold the keeper exits with the
  consumer's status and says why (after a crash between checkpoints SpecForge 0.2.0 cannot resume the
  consumer alone: acknowledged samples' features are already freed), and the run stops; ``launch
  --resume`` (or ``resilience.run_restarts``) then resumes it whole (:mod:`specforge_kimi.run.resume`). While restarts are left the consumer
  runs with ``SPECFORGE_KIMI_CONSUMER_RESTARTABLE=1``: ranks that torchrun stops with a signal
  after a sibling died do not publish ``consumer_failed`` (registration's ``restartable-consumer`` seam), so the
  producer is still there for the resumed consumer.

    python -m specforge_kimi.run.keeper --restarts 3 --backoff 2 -- python -m specforge_kimi.capture_server ...
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from specforge_kimi.registration import RESTARTABLE_ENV
from specforge_kimi.run.ledger import durable_step

_STOP = {"signum": None}


def checkpoint_step(run_dir: Path, run_id: str) -> int | None:
    """Step of ``RUN_ID-latest`` (SpecForge's symlink to the newest ``RUN_ID-step<N>``)."""
    latest = run_dir / f"{run_id}-latest"
    if not (latest / "training_state.pt").is_file():
        return None
    name = latest.resolve().name
    return int(name.rsplit("step", 1)[1]) if "-step" in name else None


def resume_argv(argv: Sequence[str], checkpoint: Path) -> list[str]:
    """``argv`` with one ``training.resume_from=`` override (replacing an earlier one)."""
    out = [a for a in argv if not a.startswith("training.resume_from=")]
    return out + [f"training.resume_from={checkpoint}"]


def _forward(signum, _frame) -> None:
    _STOP["signum"] = signum


def _stopped_during(seconds: float) -> bool:
    """Sleep ``seconds`` in short slices; True as soon as a stop signal has arrived."""
    deadline = time.monotonic() + seconds
    while _STOP["signum"] is None and (left := deadline - time.monotonic()) > 0:
        time.sleep(min(0.1, left))
    return _STOP["signum"] is not None


def _say(msg: str) -> None:
    print(f"[specforge-kimi keeper] {msg}", file=sys.stderr, flush=True)


def run(argv: Sequence[str], *, restarts: int, backoff: float, consumer: tuple[Path, str] | None = None) -> int:
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, _forward)
    current = list(argv)
    used = 0
    while True:
        env = None
        if consumer is not None:  # the restartable-consumer seam: a signalled rank of a resumable consumer stays quiet
            env = {**os.environ, RESTARTABLE_ENV: "1" if used < restarts else "0"}
        child = subprocess.Popen(current, env=env)  # same process group: the supervisor's killpg reaches it
        while child.poll() is None:
            if _STOP["signum"] is not None:
                try:
                    child.send_signal(_STOP["signum"])
                except ProcessLookupError:
                    pass
                child.wait()
                return 128 + int(_STOP["signum"])
            time.sleep(0.2)
        rc = child.returncode
        if _STOP["signum"] is not None:
            return 128 + int(_STOP["signum"])
        if consumer is not None and rc == 0:
            return 0
        if used >= restarts:
            _say(f"{current[:4]} exited with {rc}; no restarts left ({restarts})")
            return rc if rc != 0 else 1
        if consumer is not None:
            run_dir, run_id = consumer
            marker, ckpt = durable_step(run_dir), checkpoint_step(run_dir, run_id)
            if ckpt is None or marker != ckpt:
                _say(
                    f"consumer exited with {rc}; not resumable: ledger durable step {marker} != checkpoint step "
                    f"{ckpt} (SpecForge resumes an online consumer alone only at a checkpointed step); the run "
                    "stops: `specforge-kimi launch RECIPE --resume` (or resilience.run_restarts) resumes it whole"
                )
                return rc
            current = resume_argv(argv, run_dir / f"{run_id}-latest")
            _say(
                f"consumer exited with {rc}; resuming from step {ckpt} "
                f"({json.dumps(current[-1])}), restart {used + 1}/{restarts}"
            )
        else:
            _say(f"{current[:4]} exited with {rc}; restart {used + 1}/{restarts} in {backoff:.0f} s")
        used += 1
        if _stopped_during(backoff):  # a stop during the back-off ends the keeper: no new child
            _say(f"stopped by signal {_STOP['signum']} during the back-off; not restarting")
            return 128 + int(_STOP["signum"])


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        print("usage: python -m specforge_kimi.run.keeper [options] -- COMMAND...", file=sys.stderr)
        return 2
    split = argv.index("--")
    p = argparse.ArgumentParser(prog="python -m specforge_kimi.run.keeper")
    p.add_argument("--restarts", type=int, default=3)
    p.add_argument("--backoff", type=float, default=2.0)
    p.add_argument("--resume-consumer", nargs=2, metavar=("RUN_DIR", "RUN_ID"), default=None)
    args = p.parse_args(argv[:split])
    command = argv[split + 1 :]
    if not command:
        p.error("no command after --")
    consumer = (Path(args.resume_consumer[0]), args.resume_consumer[1]) if args.resume_consumer else None
    return run(command, restarts=args.restarts, backoff=args.backoff, consumer=consumer)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
