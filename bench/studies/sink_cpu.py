"""CPU timing of SGLang's spec-capture sink with and without our patches (real Mooncake, no GPU).

Loads versions of ``sglang/srt/spec_capture_sink.py`` -- SpecForge's (``a``), + our spec-capture-staging-buffer (``b``),
+ spec-capture-zero-copy (``c``), + spec-capture-parallel-put (``d``) -- from ``--sinks DIR``
(``DIR/<tag>/python/sglang/srt/``, made by applying the patches to a copy of the file
see
patches/README.md) and times ``put_samples`` on a batch laid out as the scheduler lays it out (one
host tensor per batch, per-request row slices), checking every object byte for byte. A run
``tag:N`` sets ``SGLANG_SPEC_CAPTURE_PUT_CLIENTS=N`` (spec-capture-parallel-put). Prints JSON.

    python bench/studies/sink_cpu.py --sinks /tmp/sgp 64 1024 512
    python bench/studies/sink_cpu.py --sinks /tmp/sgp --runs c,d,d:2 16 4096 512
"""

import argparse
import importlib.util
import json
import os
import time
from pathlib import Path

import torch
from mooncake.store import MooncakeDistributedStore

from specforge_kimi.run import services


def load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


ap = argparse.ArgumentParser()
ap.add_argument("--sinks", required=True)
ap.add_argument(
    "--runs",
    default="a,b,c",
    help="sink versions to time; tag:N runs tag with N put clients (spec-capture-parallel-put)",
)
ap.add_argument("n", type=int)
ap.add_argument("L", type=int)
ap.add_argument("H", type=int)
args = ap.parse_args()
n, L, H = args.n, args.L, args.H
res = {}
with services.mooncake_master(Path(args.sinks) / "mooncake.log", segment_bytes=2 << 30) as mc:
    os.environ.update(
        {
            "MOONCAKE_METADATA_SERVER": f"http://127.0.0.1:{mc.metadata_port}/metadata",
            "MOONCAKE_MASTER_SERVER_ADDR": f"127.0.0.1:{mc.rpc_port}",
            "MOONCAKE_LOCAL_HOSTNAME": "127.0.0.1",
            "MOONCAKE_GLOBAL_SEGMENT_SIZE": str(2 << 30),
            "MOONCAKE_LOCAL_BUFFER_SIZE": str(256 << 20),
        }
    )
    reader = MooncakeDistributedStore()
    reader.setup(
        "127.0.0.1",
        os.environ["MOONCAKE_METADATA_SERVER"],
        0,
        256 << 20,
        "tcp",
        "",
        os.environ["MOONCAKE_MASTER_SERVER_ADDR"],
    )
    for run in args.runs.split(","):
        tag, _, clients = run.partition(":")
        os.environ["SGLANG_SPEC_CAPTURE_PUT_CLIENTS"] = clients or "1"
        sink = load(
            f"{args.sinks}/{tag}/python/sglang/srt/spec_capture_sink.py", f"sink_{tag}_{clients or 1}"
        ).SpecCaptureSink([1, 3, 4])
        times = []
        for rep in range(4):
            # like the scheduler: one host copy per batch, per-request row slices of it
            aux_b = torch.randn(n * L, 3 * H).to(torch.bfloat16)
            last_b = torch.randn(n * L, H).to(torch.bfloat16)
            samples = []
            for i in range(n):
                aux = aux_b[i * L : (i + 1) * L]
                last = last_b[i * L : (i + 1) * L]
                spec = {
                    "store_id": "s",
                    "sample_id": f"{tag}{clients}-{rep}-{i}",
                    "gen": 1,
                    "features": {"aux": "hidden_state", "last_hidden": "target"},
                    "passthrough": [{"name": "input_ids", "data": list(range(L)), "shape": [1, L], "dtype": "int64"}],
                }
                samples.append((spec, aux, last))
            t = time.perf_counter()
            sink.put_samples(samples)
            times.append(time.perf_counter() - t)
            for spec, aux, last in samples:
                k = f"s/{spec['sample_id']}/g1/"
                assert reader.get(k + "hidden_state") == aux.contiguous().view(torch.uint8).numpy().tobytes()
                assert reader.get(k + "target") == last.contiguous().view(torch.uint8).numpy().tobytes()
                for nm in ("hidden_state", "target", "input_ids"):
                    reader.remove(k + nm)
        res[run] = [round(x, 4) for x in times]
names = {"a": "spec_capture_only", "b": "with_0001", "c": "with_0001_0002", "d": "with_0001_0002_0003"}
print(
    json.dumps(
        {
            "n": n,
            "L": L,
            "H": H,
            **{
                names[r.partition(":")[0]] + (f"_put_clients_{r.partition(':')[2]}" if r.partition(":")[2] else ""): t
                for r, t in res.items()
            },
        }
    )
)
