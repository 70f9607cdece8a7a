"""Issue 43 on the GPU box: every TCP listener of a real capture server (tiny K2.5, SGLang with its schedulers and
TP ranks) and its Mooncake master is on loopback, SGLang's distributed-init store included -- or is one of the
Mooncake binds no setting moves (docs/online.md; the same exceptions ``tests/integration/test_loopback_listeners.py``
asserts for the CPU loop): the master's HTTP metadata server, a Mooncake client's transfer-engine ports that its
own log names.

The CPU loop's test runs the stand-in server, which has no SGLang distributed init; this one lists, from ``/proc``,
the LISTEN sockets of the server's whole process tree while it serves, at TP=1 and (with two GPUs) TP=2 (NCCL's
bootstrap then listens too). Writes ``listeners_gpu_tp<N>.json`` (every listener: pid, command, address, port,
verdict) and the server log under ``$SPECFORGE_KIMI_GPU_OUT``. ~2 minutes per TP size on H200s.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import pytest
from drills import descendants
from listeners_during import listening as _listening

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]
SPEC = dict(layers=8, hidden=512, heads=8, experts=8, experts_per_token=2, moe_intermediate=256, seed=0)
AUX_IDS = [1, 3, 4]
TE_PORTS = (
    re.compile(r"Transfer Engine RPC using .*, listening on \S+:(\d+)"),
    re.compile(r"TcpTransport: listen on port (\d+)"),
)


def _listeners(pids: list[int]) -> list[dict]:
    listening, found = _listening(), []
    for pid in pids:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        except OSError:
            continue
        for link in links:
            if link.startswith("socket:[") and int(link[8:-1]) in listening:
                addr, port = listening[int(link[8:-1])]
                found.append({"pid": pid, "cmd": cmd[:200], "address": addr, "port": port})
    return found


def _gpus() -> int:
    import torch

    return torch.cuda.device_count()


@pytest.mark.parametrize("tp", [1, 2])
def test_capture_server_listens_on_loopback_only(tmp_path, tp):
    import specforge_kimi
    from specforge_kimi.run import services
    from specforge_kimi.servers.capture_server import capture_server_argv, capture_server_env
    from specforge_kimi.targets.tiny import TinySpec, write_tiny

    if _gpus() < tp:
        pytest.skip(f"needs {tp} GPUs")
    out = Path(os.environ.get("SPECFORGE_KIMI_GPU_OUT") or tempfile.mkdtemp(prefix="listeners-"))
    out.mkdir(parents=True, exist_ok=True)
    specforge_kimi.register()
    target = write_tiny(tmp_path / "k25", TinySpec(**SPEC))
    port, *mc_ports = services.free_ports(4)
    log = out / f"listeners_server_tp{tp}.log"
    with services.mooncake_master(tmp_path / "mooncake.log", segment_bytes=2 << 30, ports=mc_ports) as mc:
        argv = capture_server_argv(
            target,
            tp=tp,
            port=port,
            aux_specforge_ids=AUX_IDS,
            fusion=False,
            mem_fraction_static=0.3,
            context_length=1024,
            python=sys.executable,
        )
        env = {
            **capture_server_env(mc, cuda_visible_devices=list(range(tp))),
            "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")]),
        }
        with services.server(argv, env, log, port, timeout_s=420) as proc:
            time.sleep(5)  # every scheduler up and past its distributed init (the server answers /health after)
            server_pids = [proc.pid, *descendants(proc.pid)]
            master_pids = [p for p in descendants(os.getpid()) if p not in server_pids]
            server, master = _listeners(server_pids), _listeners(master_pids)
    logged = {int(p) for pattern in TE_PORTS for p in pattern.findall(log.read_text(errors="replace"))}
    wrong = []
    for row in server:
        loop = ipaddress.ip_address(row["address"]).is_loopback
        row["verdict"] = "loopback" if loop else "mooncake transfer engine" if row["port"] in logged else "WRONG"
        if row["verdict"] == "WRONG":
            wrong.append(row)
    for row in master:
        loop = ipaddress.ip_address(row["address"]).is_loopback
        row["verdict"] = (
            "loopback" if loop else "mooncake http metadata" if row["port"] == mc.metadata_port else "WRONG"
        )
        if row["verdict"] == "WRONG":
            wrong.append(row)
    report = {"tp": tp, "server_port": port, "capture_server": server, "mooncake_master": master, "wrong": wrong}
    (out / f"listeners_gpu_tp{tp}.json").write_text(json.dumps(report, indent=2))
    assert any(r["port"] == port and r["address"] == "127.0.0.1" for r in server), server  # the HTTP server
    assert not wrong, json.dumps(wrong, indent=2)
