"""What a Mooncake master restart does to the clients of a run (real Mooncake, loopback, no GPU): can a run
survive it live? Prints and writes JSON.

A store client that mounts a segment (as the capture sink does) and a reader client without one (as a
trainer rank's ``MooncakeFeatureStore``) are set up against a master (the argv SpecForge's managed mode
uses). One object is put and read; then the master is SIGKILLed and, after ``--down`` seconds, started
again on the same ports. Timed: each operation while it is down (put, exists, get of the old object), how
long after the restart the first put succeeds, whether the pre-kill object is still there, whether both
old clients and a new client work afterwards.

Measured 2026-12-02 (mooncake-transfer-engine-non-cuda 0.3.13.post1, 2-core CPU;
``bench/results/mooncake_master_restart_cpu.json``): while the master is down, puts, exist probes and reads
all fail (-900 RPC_FAIL), most of them after blocking ~4.2 s; the restarted master listens after ~1.4 s and
the old clients re-mount their segments by themselves (puts answer -200 until they have, ~1 s); then puts
and reads work for the old clients and a new one -- but the object put before the kill is gone (exists 0,
read -704 OBJECT_NOT_FOUND): the master alone held every object's metadata. SpecForge 0.2.0 cannot capture
a lost ref again (the consumer's read fails as not retryable; the producer has already retired the prompt),
so a run cannot continue live through a master restart: the launch stops it and ``--resume`` continues it
(docs/online.md). Measurements, never pass/fail.

    python bench/studies/mooncake_master_restart_cpu.py --out bench/results/mooncake_master_restart_cpu.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path


def _wait_tcp(port: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            s.settimeout(0.5)
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return True
        time.sleep(0.05)
    return False


@dataclass(frozen=True)
class Settings:
    down_s: float  # seconds the master stays dead
    out: Path


def parse(argv=None) -> Settings:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--down", type=float, default=10.0, help="seconds the master stays dead")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    return Settings(down_s=a.down, out=Path(a.out))


class Drill:
    """One master on fixed ports, started and killed at will; every operation timed into ``events``
    (each printed as a JSON line as it happens)."""

    def __init__(self):
        import tempfile

        from specforge_kimi.run.services import free_ports
        from specforge_kimi.servers.capture_server import mooncake_config, mooncake_master_argv

        self.rpc, self.meta, metrics = free_ports(3)
        self.argv_master = mooncake_master_argv(
            mooncake_config(rpc_port=self.rpc, metadata_port=self.meta, metrics_port=metrics)
        )
        self.log = tempfile.TemporaryFile()  # the master's output
        self.t0 = time.monotonic()
        self.events: list[dict] = []
        self.master: subprocess.Popen | None = None

    def ev(self, **kw) -> None:
        kw["t_s"] = round(time.monotonic() - self.t0, 3)
        self.events.append(kw)
        print(json.dumps(kw), flush=True)

    def start_master(self) -> float:
        started = time.monotonic()
        self.master = subprocess.Popen(
            self.argv_master, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )
        if not (_wait_tcp(self.rpc, 30) and _wait_tcp(self.meta, 30)):
            raise SystemExit("the master did not start")
        return round(time.monotonic() - started, 3)

    def kill_master(self) -> None:
        os.killpg(self.master.pid, signal.SIGKILL)
        self.master.wait()

    def timed(self, name: str, fn):
        started = time.monotonic()
        try:
            rc = fn()
        except Exception as exc:  # the binding raises for some failures, returns codes for others
            rc = f"{type(exc).__name__}: {exc}"
        self.ev(op=name, rc=rc, s=round(time.monotonic() - started, 3))
        return rc


def _after_restart(d: Drill, owner, reader, src, dst, n: int, url: str, addr: str) -> float | None:
    """The master back on the same ports: when the owner's puts work again, what the clients still see.
    Returns the seconds from the restart to the first successful put (None: none within a minute)."""
    from mooncake.store import MooncakeDistributedStore

    up = d.start_master()
    restarted = time.monotonic()
    d.ev(what="master restarted on the same ports", s=up)
    first_ok = None
    while time.monotonic() - restarted < 60:
        rc = d.timed("restarted: put_from", lambda: owner.put_from("after", ctypes.addressof(src), n))
        if rc == 0:
            first_ok = round(time.monotonic() - restarted, 3)
            break
        time.sleep(0.25)
    d.ev(what="first put after the restart", after_restart_s=first_ok)
    d.timed("restarted: is_exist before (pre-kill object)", lambda: reader.is_exist("before"))
    d.timed("restarted: get_into before (pre-kill object)", lambda: reader.get_into("before", ctypes.addressof(dst), n))
    d.timed("restarted: get_into after (old reader)", lambda: reader.get_into("after", ctypes.addressof(dst), n))
    fresh = MooncakeDistributedStore()
    d.ev(what="new client setup", rc=fresh.setup("127.0.0.1", url, 0, 16 << 20, "tcp", "", addr))
    d.timed("new client: is_exist after", lambda: fresh.is_exist("after"))
    return first_ok


def measure(s: Settings) -> tuple[list[dict], float | None]:
    """The drill: an owner and a reader set up, one object put and read; the master killed for ``down_s``
    while both keep calling; then restarted. Returns (events, first successful put after the restart)."""
    from mooncake.store import MooncakeDistributedStore

    d = Drill()
    d.ev(what="master up", s=d.start_master())
    url, addr = f"http://127.0.0.1:{d.meta}/metadata", f"127.0.0.1:{d.rpc}"
    owner, reader = MooncakeDistributedStore(), MooncakeDistributedStore()
    d.ev(what="owner setup (64 MiB segment)", rc=owner.setup("127.0.0.1", url, 64 << 20, 16 << 20, "tcp", "", addr))
    d.ev(what="reader setup (no segment)", rc=reader.setup("127.0.0.1", url, 0, 16 << 20, "tcp", "", addr))
    n = 1 << 20
    src, dst = (ctypes.c_char * n)(), (ctypes.c_char * n)()
    ctypes.memset(src, 7, n)
    owner.register_buffer(ctypes.addressof(src), n)
    reader.register_buffer(ctypes.addressof(dst), n)
    d.timed("put_from before", lambda: owner.put_from("before", ctypes.addressof(src), n))
    d.timed("get_into before", lambda: reader.get_into("before", ctypes.addressof(dst), n))
    d.kill_master()
    d.ev(what="master SIGKILLed")
    down_until = time.monotonic() + s.down_s
    while time.monotonic() < down_until:
        d.timed("down: put_from", lambda: owner.put_from(f"down{len(d.events)}", ctypes.addressof(src), n))
        d.timed("down: is_exist before", lambda: reader.is_exist("before"))
        d.timed("down: get_into before", lambda: reader.get_into("before", ctypes.addressof(dst), n))
    first_ok = _after_restart(d, owner, reader, src, dst, n, url, addr)
    d.kill_master()
    return d.events, first_ok


def write(s: Settings, events: list[dict], first_ok: float | None) -> dict:
    """The result at ``--out``: the command, the environment, a summary and every event."""
    from importlib.metadata import version

    def find(name):
        return [e for e in events if e.get("op", "").startswith(name)]

    result = {
        "benchmark": "mooncake master restart",
        "command": [sys.executable, *sys.argv],
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "environment": {
            "python": platform.python_version(),
            "mooncake": version("mooncake-transfer-engine-non-cuda"),
            "cpus": os.cpu_count(),
        },
        "down_s": s.down_s,
        "summary": {
            "down_put_s": [e["s"] for e in find("down: put_from")],
            "down_put_rc": sorted({str(e["rc"]) for e in find("down: put_from")}),
            "master_restart_listen_s": next(
                e["s"] for e in events if e.get("what") == "master restarted on the same ports"
            ),
            "first_put_after_restart_s": first_ok,
            "pre_kill_object_exists_after_restart": next(e["rc"] for e in find("restarted: is_exist before")),
            "pre_kill_object_get_after_restart_rc": next(e["rc"] for e in find("restarted: get_into before")),
        },
        "events": events,
    }
    s.out.write_text(json.dumps(result, indent=1))
    return result


def main(argv=None) -> int:
    s = parse(argv)
    events, first_ok = measure(s)
    result = write(s, events, first_ok)
    print(json.dumps(result["summary"], indent=1))
    os._exit(0)  # Mooncake's client threads would keep the interpreter alive


if __name__ == "__main__":
    raise SystemExit(main())
