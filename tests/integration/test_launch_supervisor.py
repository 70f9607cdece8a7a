"""The co-located plan runs under SpecForge's own supervisor: phases, readiness, per-role logs,
crash propagation and teardown. GPU processes are replaced by small stand-in processes at the
process boundary (a stand-in HTTP server for Mooncake's metadata and SGLang's /health); the
supervisor, readiness probing and teardown are SpecForge's real code."""

import copy
import dataclasses
import os
import sys
import time
from pathlib import Path

import yaml

from specforge_kimi.plan.run_plan import compile_plan
from specforge_kimi.run.launch import build_colocated_plan, run_plan

STUB = r"""
import http.server, socketserver, sys, threading
http_port, tcp_port = int(sys.argv[1]), int(sys.argv[2])
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path.startswith("/health") else 404); self.end_headers()
    def log_message(self, *a): pass
if tcp_port:
    s = __import__("socket").socket(); s.bind(("127.0.0.1", tcp_port)); s.listen()
print("stub up", flush=True)
socketserver.TCPServer.allow_reuse_address = True
socketserver.TCPServer(("127.0.0.1", http_port), H).serve_forever()
"""


def _plan(tmp_path, consumer_code: str):
    raw = yaml.safe_load((Path(__file__).resolve().parents[2] / "recipes" / "tiny-k25-tp2-h200x2.yaml").read_text())
    raw = copy.deepcopy(raw)
    from specforge_kimi.run.services import free_ports

    rpc, meta, srv = free_ports(3)
    raw["output_dir"] = str(tmp_path / "run")
    raw["mooncake"] = {"rpc_port": rpc, "metadata_port": meta}
    raw["server"]["port"] = srv
    compiled = compile_plan(raw, rendered_dir=tmp_path / "rendered")
    compiled.write()
    plan = build_colocated_plan(compiled, python=sys.executable)
    stub = tmp_path / "stub.py"
    stub.write_text(STUB)
    mooncake, server = plan.services
    assert (mooncake.phase, server.phase) == (0, 1)
    assert server.command.env["CUDA_VISIBLE_DEVICES"] == "0,1"  # co-located: the trainer's GPUs too
    producer, consumer = plan.commands
    assert consumer.env["CUDA_VISIBLE_DEVICES"] == "0,1" and "--nproc_per_node=2" in consumer.argv
    services = (
        dataclasses.replace(
            mooncake,
            command=dataclasses.replace(mooncake.command, argv=(sys.executable, str(stub), str(meta), str(rpc))),
        ),
        dataclasses.replace(
            server, command=dataclasses.replace(server.command, argv=(sys.executable, str(stub), str(srv), "0"))
        ),
    )
    commands = (
        dataclasses.replace(producer, argv=producer.argv[:4] + (sys.executable, "-c", "import time; time.sleep(1)")),
        dataclasses.replace(consumer, argv=consumer.argv[:4] + (sys.executable, "-c", consumer_code)),
    )
    return dataclasses.replace(plan, services=services, commands=commands, shutdown_grace_s=3.0)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _run_recording(plan):
    import subprocess

    spawned = []

    def popen(*a, **k):
        p = subprocess.Popen(*a, **k)
        spawned.append(p)
        return p

    rc = run_plan(plan, managed_preflight=lambda p: None, popen=popen)
    return rc, spawned


def test_clean_run_logs_and_teardown(tmp_path):
    plan = _plan(tmp_path, "print('trained'); import time; time.sleep(1.5)")
    rc, spawned = _run_recording(plan)
    assert rc == 0
    logs = Path(plan.services[0].log_path).parent
    assert {"mooncake.log", "capture-server-node0.log", "producer.log", "consumer-node0.log"} <= {
        p.name for p in logs.iterdir()
    }
    assert "trained" in (logs / "consumer-node0.log").read_text()
    time.sleep(0.2)
    assert not any(_alive(p.pid) for p in spawned), "a process outlived the run"


def test_child_crash_stops_everything(tmp_path):
    plan = _plan(tmp_path, "import sys; sys.exit(3)")
    t = time.monotonic()
    rc, spawned = _run_recording(plan)
    assert rc == 3
    assert time.monotonic() - t < 30
    time.sleep(0.2)
    assert not any(_alive(p.pid) for p in spawned)
