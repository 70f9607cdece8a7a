"""``tests/listeners_during.py``: the socket lister the GPU smoke runs around a co-located run tells a loopback
listener from one on every address, in the command's process tree only."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHILD = """
import socket, time
a = socket.socket(); a.bind(("127.0.0.1", 0)); a.listen()
b = socket.socket(); b.bind(("0.0.0.0", 0)); b.listen()
print(a.getsockname()[1], b.getsockname()[1], flush=True)
time.sleep(2.5)
"""


def test_lists_the_trees_listeners_with_their_verdicts(tmp_path):
    outsider = socket.socket()
    outsider.bind(("0.0.0.0", 0))
    outsider.listen()
    out = tmp_path / "l.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tests" / "listeners_during.py"),
            "--out",
            str(out),
            "--interval",
            "0.2",
            "--",
            sys.executable,
            "-c",
            CHILD,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    loop_port, any_port = map(int, proc.stdout.split()[:2])
    doc = json.loads(out.read_text())
    found = {(r["port"], r["verdict"]) for r in doc["listeners"]}
    assert found == {(loop_port, "loopback"), (any_port, "all-or-external")}
    assert [r["port"] for r in doc["off_loopback"]] == [any_port]
    assert outsider.getsockname()[1] not in {r["port"] for r in doc["listeners"]}
    outsider.close()
