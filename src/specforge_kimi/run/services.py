"""Start and stop a Mooncake master and a capture server for one measurement or test.

Scope: single-host tools (benchmarks, GPU tests, fault drills) that need the two services for a
while and must leave nothing behind. Each runs in its own process group, logs to a file, and is
stopped with SIGTERM then SIGKILL of the whole group. Long-running training goes through
:mod:`launch` (SpecForge's supervisor) instead.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from specforge_kimi.procfs import stat_fields

# SGLang 0.5.14 derives its gRPC port as --port + 10000 (unless SGLANG_GRPC_PORT is set) and
# refuses to start above 65535: an ephemeral port (up to 60999 on Linux) fails about one time in five
MAX_SERVER_PORT = 55535


def free_ports(n: int) -> list[int]:
    """``n`` distinct free loopback ports, each at most :data:`MAX_SERVER_PORT`."""
    socks, ports = [], []
    try:
        while len(ports) < n:
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)  # held until all are picked, so none repeats
            if s.getsockname()[1] <= MAX_SERVER_PORT:
                ports.append(s.getsockname()[1])
            if len(socks) > 1000 + n:
                raise RuntimeError(f"no {n} free ports at or below {MAX_SERVER_PORT}")
    finally:
        for s in socks:
            s.close()
    return ports


def port_taken(port: int, host: str = "127.0.0.1") -> bool:
    """True when a socket listens on (or is bound to) ``host:port``. Probed with SO_REUSEADDR, as servers
    usually bind (SGLang's uvicorn sets it; that Mooncake's master does is assumed, not checked):
    a closed connection still in TIME_WAIT on that port (~60 s on Linux) does not count, since it does not
    stop them from listening there. The recipe's default Mooncake ports lie inside Linux's ephemeral range,
    so a stage that just made thousands of HTTP requests (regenerate) can leave such a connection on one."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return True
    return False


def group_pids(pgid: int) -> list[int]:
    """Live processes of one process group, from /proc."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        fields = stat_fields(int(d.name))
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] != "Z":
            out.append(int(d.name))
    return out


def stop_group(proc: subprocess.Popen, grace_s: float = 20.0) -> None:
    """SIGTERM the process group, then SIGKILL after ``grace_s``; returns when it is gone."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        if proc.poll() is not None and not group_pids(proc.pid):
            return
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        deadline = time.time() + wait
        while time.time() < deadline:
            if proc.poll() is not None and not group_pids(proc.pid):
                return
            time.sleep(0.3)


def wait_tcp(port: int, timeout_s: float, host: str = "127.0.0.1") -> bool:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        with socket.socket() as s:
            s.settimeout(1.0)
            if s.connect_ex((host, port)) == 0:
                return True
        time.sleep(0.3)
    return False


def health(port: int, path: str = "/health") -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status == 200
    except Exception:
        return False


@contextmanager
def mooncake_master(
    log_path: Path, *, segment_bytes: int = 8 << 30, buffer_bytes: int = 1 << 30, ports: Sequence[int] | None = None
) -> Iterator:
    """A loopback Mooncake master; yields SpecForge's ``ManagedLocalMooncakeConfig`` for it."""
    from specforge_kimi.servers.capture_server import mooncake_config, mooncake_master_argv

    rpc, meta, metrics = ports or free_ports(3)
    mc = mooncake_config(
        rpc_port=rpc,
        metadata_port=meta,
        metrics_port=metrics,
        global_segment_size_bytes=segment_bytes,
        local_buffer_size_bytes=buffer_bytes,
    )
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            mooncake_master_argv(mc),
            env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            if not (wait_tcp(rpc, 30) and wait_tcp(meta, 30)) or proc.poll() is not None:
                raise RuntimeError(f"mooncake master did not come up; see {log_path}")
            yield mc
        finally:
            stop_group(proc, grace_s=5)


@contextmanager
def server(argv: Sequence[str], env: dict, log_path: Path, port: int, timeout_s: float = 600.0) -> Iterator:
    """Any HTTP server with ``/health`` (a capture server); yields the Popen once healthy."""
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            list(argv), env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            deadline = time.time() + timeout_s
            while not health(port):
                if proc.poll() is not None:
                    raise RuntimeError(f"server exited with {proc.returncode} while starting; see {log_path}")
                if time.time() > deadline:
                    raise TimeoutError(f"server not healthy after {timeout_s:.0f} s; see {log_path}")
                time.sleep(1.0)
            yield proc
        finally:
            stop_group(proc)
