"""How fast is the capture sink's Mooncake put when the segment lives in the putting process, and
does it hold the GIL? (real Mooncake, loopback master, no GPU). Prints and writes JSON.

The co-located loop's default layout (``resilience.segment_owner: server``) mounts the feature
segment inside the capture server, so the sink's ``batch_put_from`` lands in its own process: a
Mooncake local memcpy, not TCP (Mooncake's ``MC_STORE_MEMCPY`` path; its TCP tunables do not
apply). This measures, for one batch shaped like ``bench/online_pipeline.py``'s 16x4096 tiny-K2.5
batch (16 objects of 4096 x 2048 bf16 = 16.8 MB, from one registered host buffer):

- ``threads``: median time of the batch's put issued as one ``batch_put_from`` or split over T
  Python threads (does the put scale with threads?);
- ``gil``: while one thread runs the put, how far a pure-Python loop in the main thread gets,
  relative to the same loop alone (about 1: the binding releases the GIL, so the put does not stall
  the scheduler's Python; about 0: it holds it).

- ``clients`` (with ``--clients``): the batch split over C store clients of the one process, each
  mounting its own segment and putting its share into it (``ReplicateConfig.preferred_segment``)
  from its own thread. Mooncake copies a client's local puts on one memcpy thread per client
  (``transfer_task.cpp``: ``kDefaultMemcpyWorkers = 1``, not configurable), so more threads on one
  client do not help (``threads``); this asks whether more clients do.

Measurements, never pass/fail. The first repetition includes first-touch of the segment's pages.

    python bench/studies/mooncake_put_cpu.py --out bench/results/mooncake_put_cpu.json
    python bench/studies/mooncake_put_cpu.py --threads 1 --clients 1,2 --out bench/results/mooncake_put_clients_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Settings:
    """The flags: the batch's shape, what to time and where the result goes."""

    samples: int
    tokens: int
    hidden: int
    threads: tuple[int, ...]
    reps: int
    clients: tuple[int, ...]
    out: Path

    @property
    def bytes_per_object(self) -> int:
        return self.tokens * 4 * self.hidden * 2


def parse(argv=None) -> Settings:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=512, help="target hidden size (aux 3H + last H per token)")
    p.add_argument("--threads", default="1,2,4")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--clients", default="", help="comma list of store-client counts (each its own segment) to time")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    return Settings(
        samples=a.samples,
        tokens=a.tokens,
        hidden=a.hidden,
        threads=tuple(int(t) for t in a.threads.split(",")),
        reps=a.reps,
        clients=tuple(int(c) for c in a.clients.split(",") if c),
        out=Path(a.out),
    )


def _document(s: Settings) -> dict:
    import torch

    n, per = s.samples, s.bytes_per_object
    return {
        "benchmark": "mooncake same-process put",
        "command": [sys.executable, *sys.argv],
        "environment": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cpu_count": os.cpu_count(),
            "processor": platform.processor() or platform.machine(),
        },
        "config": {
            "samples": n,
            "bytes_per_object": per,
            "batch_bytes": n * per,
            "reps": s.reps,
            "segment": "mounted by the putting process (segment_owner: server)",
            "protocol": "tcp",
        },
        "threads": {},
        "gil": [],
    }


def _store(mc, segment: int):
    """A store client of this process mounting its own ``segment`` bytes (the capture server's layout)."""
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    rc = store.setup(
        "127.0.0.1",
        f"http://127.0.0.1:{mc.metadata_port}/metadata",
        segment,
        256 << 20,
        "tcp",
        "",
        f"127.0.0.1:{mc.rpc_port}",
    )
    if rc:
        raise SystemExit(f"mooncake setup failed: {rc}")
    return store


def _time_threads(store, put, ptrs: list[int], T: int, s: Settings) -> dict:
    """The batch's put split over ``T`` Python threads, ``--reps`` times; the median leaves out the first."""
    n, per = s.samples, s.bytes_per_object
    times = []
    for rep in range(s.reps):
        keys = [f"t{T}-{rep}-{i}" for i in range(n)]
        t0 = time.perf_counter()
        th = [threading.Thread(target=put, args=(keys[j::T], ptrs[j::T])) for j in range(T)]
        for t in th:
            t.start()
        for t in th:
            t.join()
        times.append(time.perf_counter() - t0)
        for k in keys:
            store.remove(k)
    med = sorted(times[1:] or times)[len(times[1:] or times) // 2]
    return {
        "median_ms": round(med * 1e3, 1),
        "GB_per_s": round(n * per / med / 1e9, 2),
        "all_ms": [round(t * 1e3, 1) for t in times],
    }


def _time_gil(store, put, ptrs: list[int], rep: int, n: int) -> dict:
    """One put on a thread while the main thread counts: its progress over the same loop alone."""
    stop = [False]

    def spin(seconds):
        end, k = time.perf_counter() + seconds, 0
        while time.perf_counter() < end and not stop[0]:
            k += 1
        return k

    alone = spin(0.3) / 0.3
    keys = [f"g{rep}-{i}" for i in range(n)]
    took = {}

    def timed_put(keys=keys, took=took):
        t0 = time.perf_counter()
        put(keys, ptrs)
        took["s"] = time.perf_counter() - t0
        stop[0] = True

    th = threading.Thread(target=timed_put)
    t0 = time.perf_counter()
    th.start()
    k = spin(600.0)
    wall = time.perf_counter() - t0
    th.join()
    for key in keys:
        store.remove(key)
    return {"put_ms": round(took["s"] * 1e3, 1), "main_thread_progress": round(k / wall / alone, 3)}


def measure(s: Settings) -> dict:
    """Threads, then clients, then the GIL check, on one loopback master; each line printed as it comes."""
    import torch

    from specforge_kimi.run import services

    n, per = s.samples, s.bytes_per_object
    result = _document(s)
    segment = n * per * 2 + (256 << 20)  # two batches in flight, plus headroom
    with (
        tempfile.TemporaryDirectory() as tmp,
        services.mooncake_master(Path(tmp) / "mooncake.log", segment_bytes=segment) as mc,
    ):
        store = _store(mc, segment)
        buf = torch.randn(n * s.tokens, 4 * s.hidden).to(torch.bfloat16)
        base = buf.data_ptr()
        store.register_buffer(base, buf.numel() * 2)
        ptrs = [base + i * per for i in range(n)]

        def put(keys, pointers):
            status = store.batch_put_from(keys, pointers, [per] * len(keys))
            if any(x != 0 for x in status):
                raise SystemExit(f"batch_put_from failed: {status}")

        for T in s.threads:
            result["threads"][str(T)] = _time_threads(store, put, ptrs, T, s)
            print(f"{T} thread(s): {result['threads'][str(T)]}", flush=True)

        for C in s.clients:
            result.setdefault("clients", {})[str(C)] = _time_clients(C, n, per, buf, mc, s.reps)
            print(f"{C} client(s): {result['clients'][str(C)]}", flush=True)

        for rep in range(s.reps):
            result["gil"].append(_time_gil(store, put, ptrs, rep, n))
            print(f"gil rep {rep}: {result['gil'][-1]}", flush=True)
    return result


def write(s: Settings, result: dict) -> None:
    s.out.write_text(json.dumps(result, indent=2))


def main(argv=None) -> int:
    s = parse(argv)
    write(s, measure(s))
    return 0


def _time_clients(C: int, n: int, per: int, buf, mc, reps: int) -> dict:
    """The batch's put split over ``C`` clients of this process, each into its own segment, one
    thread per client; every object read back and compared once."""
    import torch
    from mooncake.store import MooncakeDistributedStore, ReplicateConfig

    share = -(-n // C)
    clients = []
    for _ in range(C):
        st = MooncakeDistributedStore()
        rc = st.setup(
            "127.0.0.1",
            f"http://127.0.0.1:{mc.metadata_port}/metadata",
            share * per * 2 + (64 << 20),
            64 << 20,
            "tcp",
            "",
            f"127.0.0.1:{mc.rpc_port}",
        )
        if rc:
            raise SystemExit(f"mooncake setup failed: {rc}")
        st.register_buffer(buf.data_ptr(), buf.numel() * 2)
        cfg = ReplicateConfig()
        cfg.preferred_segment = st.get_hostname()
        clients.append((st, cfg))
    base = buf.data_ptr()
    times, errors = [], []

    def put(st, cfg, idx, keys):
        status = st.batch_put_from([keys[i] for i in idx], [base + i * per for i in idx], [per] * len(idx), cfg)
        if any(x != 0 for x in status):
            errors.append(status)

    for rep in range(reps):
        keys = [f"c{C}-{rep}-{i}" for i in range(n)]
        parts = [list(range(j * share, min(n, (j + 1) * share))) for j in range(C)]
        t0 = time.perf_counter()
        th = [threading.Thread(target=put, args=(*clients[j], parts[j], keys)) for j in range(C)]
        for t in th:
            t.start()
        for t in th:
            t.join()
        times.append(time.perf_counter() - t0)
        if errors:
            raise SystemExit(f"batch_put_from failed: {errors}")
        if rep == 0:  # the bytes landed where they should
            raw = buf.view(-1).view(torch.uint8)
            for i in range(n):
                if clients[0][0].get(keys[i]) != raw[i * per : (i + 1) * per].numpy().tobytes():
                    raise SystemExit(f"object {keys[i]} differs after the put")
        for j, idx in enumerate(parts):
            for i in idx:
                clients[j][0].remove(keys[i])
    med = sorted(times[1:] or times)[len(times[1:] or times) // 2]
    for st, _ in clients:
        st.close()
    return {
        "median_ms": round(med * 1e3, 1),
        "GB_per_s": round(n * per / med / 1e9, 2),
        "all_ms": [round(t * 1e3, 1) for t in times],
    }


if __name__ == "__main__":
    raise SystemExit(main())
