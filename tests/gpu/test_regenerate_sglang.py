"""`specforge-kimi regenerate` against a real SGLang server serving a tiny K2.5 (GPU, marker gpu).

The tiny target is pretrained on the GPU for ~40 s on the synthetic corpus (so it answers and
stops at ``<|im_end|>``, a random-weight target never stops within max_tokens and every row would
be skipped) and carries the stand-in tokenizer with its text-only K2.5 chat template; the server
is started text-only through ``specforge_kimi.capture_server`` (no spec capture needed here)
with ``--reasoning-parser kimi_k2`` so thinking output comes back as ``reasoning_content``.
The point is the protocol (concurrency, thinking on, reasoning split, output format) on a real server.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

OUT = Path(os.environ.get("SPECFORGE_KIMI_GPU_OUT", "/tmp/specforge-kimi-gpu"))


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(url: str, proc, timeout: float) -> None:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(2)
    raise TimeoutError(f"server not healthy after {timeout}s")


def test_regenerate_against_sglang(tmp_path):
    from specforge_kimi.data import corpus
    from specforge_kimi.data.tokenizer import build_standin_tokenizer
    from specforge_kimi.demo.pipeline import DEMO_TARGET, _rows
    from specforge_kimi.demo.pretrain import pretrain
    from specforge_kimi.targets.tiny import TinySpec, write_tiny

    tok = build_standin_tokenizer()
    rows = _rows(list(corpus.conversations(2000, seed=1)), tok)
    raw = write_tiny(tmp_path / "raw", TinySpec(**DEMO_TARGET))
    pre = pretrain(
        str(raw),
        [i for i, _ in rows],
        str(tmp_path / "tiny"),
        seconds=40,
        batch_size=32,
        lr=2e-3,
        progress=False,
        device="cuda",
    )
    model = tmp_path / "tiny"
    tok.save_pretrained(model)
    port = _port()
    OUT.mkdir(parents=True, exist_ok=True)
    log = open(OUT / "regenerate_server.log", "w")
    cmd = [
        sys.executable,
        "-m",
        "specforge_kimi.capture_server",
        "--model-path",
        str(model),
        "--tp-size",
        "1",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--attention-backend",
        "triton",
        "--disable-cuda-graph",
        "--mem-fraction-static",
        "0.3",
        "--reasoning-parser",
        "kimi_k2",
        "--served-model-name",
        "tiny-k25",
    ]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait(f"http://127.0.0.1:{port}/health", proc, 300)
        rows = [
            {
                "messages": [
                    {"role": "user", "content": f"Count from {i} to {i + 5}."},
                    {"role": "assistant", "content": "old answer"},
                ]
            }
            for i in range(12)
        ]
        src = tmp_path / "in.jsonl"
        src.write_text("".join(json.dumps(r) + "\n" for r in rows))
        dst = tmp_path / "out.jsonl"
        t = time.monotonic()
        res = subprocess.run(
            [
                sys.executable,
                "-m",
                "specforge_kimi",
                "regenerate",
                str(src),
                "--server",
                f"http://127.0.0.1:{port}",
                "--out",
                str(dst),
                "--concurrency",
                "4",
                "--max-tokens",
                "160",
                "--temperature",
                "0",
                "--no-progress",
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        wall = time.monotonic() - t
        errors = tmp_path / "out.jsonl.errors.jsonl"
        (OUT / "regenerate_errors.jsonl").write_text(errors.read_text() if errors.exists() else "")
        (OUT / "regenerate_stdout.txt").write_text(res.stdout + "\n" + res.stderr[-3000:])
        assert res.returncode == 0, res.stderr[-3000:]
        out = [json.loads(line) for line in dst.read_text().splitlines()]
        assert len(out) >= 8, res.stdout  # rows whose generation hit max_tokens are skipped by design
        for row in out:
            last = row["messages"][-1]
            assert last["role"] == "assistant" and last["content"] != "old answer" or last.get("reasoning_content")
        summary = {
            "command": cmd,
            "rows": len(out),
            "pretrain": {"steps": pre.steps, "loss_first": pre.first_loss, "loss_last": pre.last_loss},
            "regenerate_stdout": res.stdout,
            "wall_s": round(wall, 2),
            "stderr_tail": res.stderr[-1500:],
            "example": out[0]["messages"][-1],
        }
        (OUT / "regenerate_sglang.json").write_text(json.dumps(summary, indent=2))
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
