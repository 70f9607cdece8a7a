"""Online-pipeline benchmark: capture overhead on SGLang prefill, feature bytes and transport rate,
plus the trainer / end-to-end rates and GPU memory of an online run (from ``run-report``).

Needs a GPU box with the pinned stack and SpecForge's spec-capture patch (the GPU bundle). For
each TP size it starts one Mooncake master and one text-only capture server
(``--enable-spec-capture``, all-reduce fusion off, triton attention), then for each batch shape
(default 64x1024 and 16x4096 tokens) times, interleaved, 1 warm-up + ``--reps`` of
  plain    POST /generate with the token batch, max_new_tokens 1 (no ``spec_capture``)
  capture  SpecForge's producer call, ``SGLangServerCaptureAdapter.produce_refs`` (same server,
           same prompts; the server copies aux + last hidden states to the host and puts them
           into Mooncake before answering)
  read     SpecForge's consumer read, ``MooncakeFeatureStore.get`` of every ref of the batch
and reports medians: prefill tok/s both ways and their ratio, feature bytes per token, the
capture write rate (feature bytes / capture time) and read rate. One batch at a time, a capture
call's time includes the server's host transfer and Mooncake put of its own batch. The capture
patch runs that transfer on a background thread beside the *next* prefill (``_queue_spec_captures``,
at most ``SGLANG_SPEC_CAPTURE_MAX_PENDING_BATCHES`` batches, default 2), and SpecForge's producer
keeps ``runtime.producer_concurrency`` capture calls in flight (default 1). With ``--in-flight K``
(K > 1) each shape is also timed with K batches in flight from K threads sharing the adapter, as
the producer's own workers do, for ``--reps`` rounds each way: aggregate prefill tok/s plain and
with capture, and their ratio, the rate a producer with ``producer_concurrency: K`` could reach.
The server runs with ``SGLANG_SPEC_CAPTURE_TIMING=1``; its per-batch sink timings (materialize,
register, put) are summed per shape to show where capture time goes. Prompts are random token ids
(prefill cost does not depend on them). Timings are measurements, never pass/fail.

    python bench/online_pipeline.py --target runs/tiny-k25 --tp 1 2 \
        --run-report /tmp/online-run/online_run.json --out bench/results/online_pipeline_h200x2.json

``--put-clients 1 4`` runs each TP size once per value: the capture sink splits each batch's Mooncake
put over that many store clients (our SGLang patch spec-capture-parallel-put, ``SGLANG_SPEC_CAPTURE_PUT_CLIENTS``).

``--compact-passthrough`` makes the producer's own calls (``capture``, in flight) send the passthrough
compactly, as a recipe with ``server.compact_passthrough: true`` does; refused when our SpecForge patch compact-capture-passthrough
(or, for the SGLang engine, SGLang patch spec-capture-compact-passthrough) is not applied.

``--transport mooncake,cuda_ipc`` measures each feature transport in the same run, one server per TP size and
transport (each started with it: ``cuda_ipc`` servers carry ``SGLANG_SPEC_CAPTURE_TRANSPORT=cuda_ipc`` and a pool of
``--ipc-pool-gib``; SGLang patch spec-capture-cuda-ipc), the same seeded prompts on each: capture/plain prefill, the read rate
(``cuda_ipc``: our ``CudaIpcFeatureStore.get`` mapping the server's pool by CUDA IPC in this process and copying
each sample into fresh tensors on GPU 0), the pool's bytes and the server's GPU memory (nvidia-smi). Every shape
entry names its ``"transport"`` beside ``capture_over_plain``; ``transport_comparison`` sets them side by side with
the read-rate ratio and whether the features of the first measured round hashed equal on both (two servers with
SGLang's default kernels: information, not a test -- ``tests/gpu/test_cuda_ipc.py`` is the bit-for-bit check; on
an INT4 target they need not match at all: SGLang 0.5.14's fused Marlin MoE sets ``use_atomic_add`` for bf16 on
compute capability >= 9 whatever ``--enable-deterministic-inference`` says, so its k-split partial sums land in
any order).
A ``cuda_ipc`` server's sink logs ``ipc_sink`` timings (reclaim, wait for pool space, copy issue, copy wait).

``--breakdown`` also splits a capture call's time per shape (``bench_breakdown``): the same
``/generate`` body SpecForge's producer builds, JSON-encoded on the client (timed apart) and posted
as bytes, in five variants posted in turn: ``plain`` (no ``spec_capture``), ``bookkeeping``
(``spec_capture`` naming no feature and no passthrough: the capture mode's cost without a sink
write), ``features`` (aux + last hidden, no passthrough) and ``full`` (the producer's body: also
input_ids / loss_mask / attention_mask sent as JSON int lists for the sink to store), and
``compact`` (the same with ``SPECFORGE_SPEC_CAPTURE_COMPACT=1``: our SpecForge patch compact-capture-passthrough sends
those three compactly and SGLang patch spec-capture-compact-passthrough rebuilds them; an error is recorded for it where
either patch is missing). Differences
of the medians attribute the capture cost to the capture mode, the feature sink and the
passthrough lists; ``producer_minus_full`` is what SpecForge's ``produce_refs`` adds around the
post (ref construction, JSON decode of the response). The server log's ``async_batch_complete``
lines give its own queue-to-stream time per batch.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import NamedTuple

AUX_IDS = [1, 3, 4]  # SpecForge ids (captured positions 2, 4, 5); --aux-ids for targets of other depths
SERVER_START_TIMEOUT_S = 420.0  # --server-start-timeout: a host's first INT4 prefill compiles SGLang's Marlin MoE
QUEUE = re.compile(r"\[spec-capture-timing\] async_batch_complete samples=(\d+) queue_to_stream_ms=([\d.]+)")
TIMING = re.compile(
    r"\[spec-capture-timing\] batch_sink samples=(\d+) objects=(\d+) bytes=(\d+) "
    r"materialize_ms=([\d.]+) register_ms=([\d.]+) put_ms=([\d.]+) total_ms=([\d.]+)"
)


TIMING_IPC = re.compile(
    r"\[spec-capture-timing\] ipc_sink samples=(\d+) bytes=(\d+) reclaim_ms=([\d.]+) wait_ms=([\d.]+) "
    r"issue_ms=([\d.]+) copy_wait_ms=([\d.]+) total_ms=([\d.]+)"
)
TRANSPORTS = ("mooncake", "cuda_ipc")


def _post(url: str, body: dict, timeout: float = 600.0):
    import requests

    r = requests.post(url, json=body, timeout=timeout)
    r.raise_for_status()
    return r.json()


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(1000, 150000) for _ in range(length)] for _ in range(n)]


def _tasks(prompts, run_id: str, tag: str):
    from specforge.runtime.contracts import PromptTask

    return [
        PromptTask(
            task_id=f"{tag}-{i}",
            run_id=run_id,
            source_id="bench",
            payload={"input_ids": p, "loss_mask": [1] * len(p)},
            max_length=len(p) + 1,
            metadata={"num_tokens": len(p)},
        )
        for i, p in enumerate(prompts)
    ]


def _free(store, refs) -> None:
    from specforge.runtime.data_plane.feature_store import drain_feature_store_removals

    for ref in refs:
        try:
            store.abort(ref.sample_id, reason="bench")
        except Exception:
            pass
    drain_feature_store_removals(store)


def _plain(url: str, prompts) -> None:
    """One prefill of ``prompts`` without ``spec_capture`` (fresh cache namespace, one new token)."""
    _post(
        f"{url}/generate",
        {
            "input_ids": prompts,
            "extra_key": [uuid.uuid4().hex for _ in prompts],
            "sampling_params": {"temperature": 0.0, "max_new_tokens": 1},
        },
    )


def _capture(adapter, cfg, prompts, tag: str) -> list:
    """SpecForge's producer call on ``prompts``; raises if any sample's capture failed."""
    from specforge.inference.adapters.server_capture import ServerCaptureFailure

    refs = adapter.produce_refs(_tasks(prompts, adapter.run_id, tag), capture=cfg)
    failed = [r for r in refs if isinstance(r, ServerCaptureFailure)]
    if failed:
        raise RuntimeError(f"capture failed: {failed[0].reason}")
    return refs


def _feature_hash(h, tensors: dict) -> None:
    """Feed a sample's features, by name, into the hash ``h`` (their raw bytes, wherever they live)."""
    import torch

    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().reshape(-1).view(torch.uint8).cpu()
        h.update(name.encode())
        h.update(t.numpy().tobytes())


def bench_shape(
    url: str, adapter, cfg, store, n: int, length: int, reps: int, log: Path, transport: str = "mooncake"
) -> dict:
    import hashlib

    prompts = _prompts(n, length, seed=length * 1000 + n)
    tokens = n * length
    plain_s, capture_s, read_s, fbytes = [], [], [], []
    digest = None
    log_start = log.stat().st_size if log.exists() else 0
    for rep in range(reps + 1):
        t = time.perf_counter()
        _plain(url, prompts)
        dt_plain = time.perf_counter() - t
        t = time.perf_counter()
        refs = _capture(adapter, cfg, prompts, f"r{rep}-{n}x{length}")
        dt_cap = time.perf_counter() - t
        for ref in refs:
            store.adopt(ref)
        dt_read = 0.0
        nbytes = 0
        h = hashlib.sha256() if rep == 1 else None
        for ref in refs:
            t = time.perf_counter()
            tensors, handle = store.get(ref)
            dt_read += time.perf_counter() - t  # the store's get returns once its copies are done
            nbytes += sum(int(v.numel() * v.element_size()) for v in tensors.values())
            store.release(handle)
            if h is not None:
                _feature_hash(h, tensors)
            del tensors
        if h is not None:
            digest = h.hexdigest()
        _free(store, refs)
        if rep == 0:
            continue  # warm-up
        plain_s.append(dt_plain)
        capture_s.append(dt_cap)
        read_s.append(dt_read)
        fbytes.append(nbytes)
    pattern, keys = (
        (TIMING_IPC, ("samples", "bytes", "reclaim_ms", "wait_ms", "issue_ms", "copy_wait_ms", "total_ms"))
        if transport == "cuda_ipc"
        else (TIMING, ("samples", "objects", "bytes", "materialize_ms", "register_ms", "put_ms", "total_ms"))
    )
    sink = [tuple(float(x) for x in m.groups()) for m in pattern.finditer(log.read_text(errors="replace")[log_start:])]
    sink_tot = {k: sum(s[i] for s in sink) / (reps + 1) for i, k in enumerate(keys)}
    p, c, r = statistics.median(plain_s), statistics.median(capture_s), statistics.median(read_s)
    fb = statistics.median(fbytes)
    return {
        "batch": n,
        "tokens_per_prompt": length,
        "tokens": tokens,
        "reps": reps,
        "plain_s": plain_s,
        "capture_s": capture_s,
        "read_s": read_s,
        "plain_tokens_per_s": tokens / p,
        "capture_tokens_per_s": tokens / c,
        "transport": transport,
        "capture_over_plain": p / c,
        "features_sha256": digest,  # the first measured round's reads, every sample's features in order
        "feature_bytes_per_token": fb / tokens,
        "capture_write_gb_per_s": fb / c / 1e9,
        "read_gb_per_s": fb / r / 1e9,
        "capture_extra_ms": (c - p) * 1000,
        "sink_per_request_mean": sink_tot,
        "sink_batches_seen": len(sink),
    }


def _variant_body(adapter, prompts, tag: str, variant: str) -> tuple[dict, list]:
    """The producer's ``/generate`` body for ``prompts`` (``capture_features.producer_body``: SpecForge's
    own builders), cut down to ``variant``; and the (sample_id, names) it makes the server write."""
    from specforge_kimi.run.offline_twin import producer_body

    body = producer_body(adapter, _tasks(prompts, adapter.run_id, tag), compact=variant == "compact")
    if variant == "plain":
        del body["spec_capture"]
        return body, []
    payloads = body["spec_capture"]
    if variant == "compact" and any("data" in i for pl in payloads for i in pl["passthrough"]):
        raise RuntimeError(
            "the installed SpecForge lacks SpecForge patch compact-capture-passthrough (its compact body still carries "
            "JSON lists)"
        )
    for pl in payloads:
        if variant in ("bookkeeping", "features"):
            pl["passthrough"] = []
        if variant == "bookkeeping":
            pl["features"] = {}
    written = [
        (pl["sample_id"], [*pl["features"].values(), *(i["name"] for i in pl["passthrough"])]) for pl in payloads
    ]
    return body, [w for w in written if w[1]]


BREAKDOWN_VARIANTS = ("plain", "bookkeeping", "features", "full", "compact")


def bench_breakdown(url: str, adapter, store, n: int, length: int, reps: int, log: Path) -> dict:
    """Per variant (``BREAKDOWN_VARIANTS``), 1 warm-up + ``reps`` rounds, interleaved: client JSON
    encode ms and post ms (request sent as bytes to the answer); medians and their differences."""
    import requests
    from specforge.runtime.data_plane.feature_store import drain_feature_store_removals

    prompts = _prompts(n, length, seed=length * 1000 + n)
    enc: dict = {v: [] for v in BREAKDOWN_VARIANTS}
    post: dict = {v: [] for v in BREAKDOWN_VARIANTS}
    body_bytes: dict = {}
    errors: dict = {}
    log_start = log.stat().st_size if log.exists() else 0
    for rnd in range(reps + 1):
        for v in BREAKDOWN_VARIANTS:
            if v in errors:
                continue
            try:
                body, written = _variant_body(adapter, prompts, f"bd{rnd}-{v}-{n}x{length}", v)
            except RuntimeError as exc:
                errors[v] = str(exc)
                continue
            for sample_id, names in written:
                store.track_external_attempt(sample_id, generation=1, feature_names=names)
            t = time.perf_counter()
            data = json.dumps(body).encode()
            t_enc = time.perf_counter() - t
            t = time.perf_counter()
            try:
                r = requests.post(
                    f"{url}/generate", data=data, headers={"Content-Type": "application/json"}, timeout=600
                )
                r.raise_for_status()
                rows = r.json()
                rows = rows if isinstance(rows, list) else [rows]
                bad = [
                    row["meta_info"]["spec_capture"]
                    for row in rows
                    if isinstance((row.get("meta_info") or {}).get("spec_capture"), dict)
                    and "error" in row["meta_info"]["spec_capture"]
                ]
                t_post = time.perf_counter() - t
                if bad:
                    raise RuntimeError(f"capture error: {bad[0]['error']}")
            except Exception as exc:  # a variant the server refuses is recorded, the others go on
                errors[v] = f"{type(exc).__name__}: {exc}"[:400]
                continue
            finally:  # the keys the server wrote for this post, removed before the next one
                store.discard_external_attempts(reason="bench-breakdown")
                drain_feature_store_removals(store)
            body_bytes[v] = len(data)
            if rnd:
                enc[v].append(t_enc * 1000)
                post[v].append(t_post * 1000)
    med = {
        v: {"encode_ms": statistics.median(enc[v]), "post_ms": statistics.median(post[v]), "body_bytes": body_bytes[v]}
        for v in BREAKDOWN_VARIANTS
        if post[v]
    }
    out: dict = {
        "batch": n,
        "tokens_per_prompt": length,
        "reps": reps,
        "variants": med,
        "post_ms": post,
        "encode_ms": enc,
        "errors": errors,
    }
    batches = [
        (int(m.group(1)), float(m.group(2))) for m in QUEUE.finditer(log.read_text(errors="replace")[log_start:])
    ]
    out["server_queue_to_stream_ms"] = [ms for _, ms in batches]
    out["server_batch_samples"] = [n for n, _ in batches]  # how SGLang split the calls into scheduler batches
    if all(v in med for v in BREAKDOWN_VARIANTS if v != "compact"):
        out["attribution_ms"] = {
            "capture_mode (bookkeeping - plain)": med["bookkeeping"]["post_ms"] - med["plain"]["post_ms"],
            "feature_sink (features - bookkeeping)": med["features"]["post_ms"] - med["bookkeeping"]["post_ms"],
            "passthrough_server (full - features)": med["full"]["post_ms"] - med["features"]["post_ms"],
            "passthrough_client_encode (full - plain)": med["full"]["encode_ms"] - med["plain"]["encode_ms"],
        }
        if "compact" in med:
            out["attribution_ms"]["compact_saves_server (full - compact)"] = (
                med["full"]["post_ms"] - med["compact"]["post_ms"]
            )
            out["attribution_ms"]["compact_saves_client_encode (full - compact)"] = (
                med["full"]["encode_ms"] - med["compact"]["encode_ms"]
            )
    return out


def bench_in_flight(url: str, adapter, cfg, store, n: int, length: int, reps: int, k: int) -> dict:
    """``reps`` rounds each of ``k`` concurrent plain batches, then ``k`` concurrent capture calls
    (after one warm-up round of each): aggregate prefill tokens per second, medians over rounds."""
    from concurrent.futures import ThreadPoolExecutor

    batches = [_prompts(n, length, seed=length * 1000 + n + 7919 * (j + 1)) for j in range(k)]
    tokens = k * n * length
    plain_s, capture_s, captured = [], [], []
    with ThreadPoolExecutor(max_workers=k) as pool:
        for rnd in range(reps + 1):
            t = time.perf_counter()
            list(pool.map(lambda b: _plain(url, b), batches))
            dt_plain = time.perf_counter() - t
            t = time.perf_counter()
            got = list(
                pool.map(
                    lambda jb, rnd=rnd: _capture(adapter, cfg, jb[1], f"k{k}-r{rnd}-b{jb[0]}-{n}x{length}"),
                    enumerate(batches),
                )
            )
            dt_cap = time.perf_counter() - t
            for refs in got:
                for ref in refs:
                    store.adopt(ref)
                _free(store, refs)
            if rnd:  # round 0 is the warm-up
                plain_s.append(dt_plain)
                capture_s.append(dt_cap)
                captured.append(sum(len(refs) for refs in got))
    p, c = statistics.median(plain_s), statistics.median(capture_s)
    return {
        "in_flight": k,
        "tokens_per_round": tokens,
        "reps": reps,
        "plain_s": plain_s,
        "capture_s": capture_s,
        "samples_captured_per_round": captured,
        "plain_tokens_per_s": tokens / p,
        "capture_tokens_per_s": tokens / c,
        "capture_over_plain": p / c,
    }


def _server_argv(
    target: str, engine: str, tp: int, port: int, longest: int, aux_ids: list[int], mem_fraction_static: float = 0.5
) -> list[str]:
    """The capture server's command line: SGLang with spec capture, or the CPU reference stand-in."""
    from specforge_kimi.servers.capture_server import capture_server_argv

    if engine == "reference":  # the CPU stand-in: exercises this script without a GPU
        return [
            sys.executable,
            "-m",
            "specforge_kimi.servers.reference_server",
            "--model-path",
            target,
            "--spec-capture-aux-layer-ids",
            *map(str, aux_ids),
            "--port",
            str(port),
            "--dtype",
            "bfloat16",
        ]
    return capture_server_argv(
        target,
        tp=tp,
        port=port,
        aux_specforge_ids=aux_ids,
        fusion=False,
        attention_backend="triton",
        mem_fraction_static=mem_fraction_static,
        context_length=longest + 256,
        disable_cuda_graph=True,
        python=sys.executable,
    )


def _extra_rounds(url: str, tools, timed: list[dict], shapes, reps: int, log: Path, in_flight: int, breakdown: bool):
    """After the one-batch rounds, on the same server: each shape in flight and its capture-time breakdown, if asked."""
    adapter, cfg, store = tools
    if in_flight > 1:
        for shape, (n, length) in zip(timed, shapes, strict=False):
            shape["in_flight"] = bench_in_flight(url, adapter, cfg, store, n, length, reps, in_flight)
    if breakdown:
        for shape, (n, length) in zip(timed, shapes, strict=False):
            shape["breakdown"] = bench_breakdown(url, adapter, store, n, length, reps, log)
            full = shape["breakdown"]["variants"].get("full")  # absent when the server refused it
            shape["breakdown"]["producer_minus_full_ms"] = (
                statistics.median(shape["capture_s"]) * 1000 - full["post_ms"] - full["encode_ms"] if full else None
            )


def run_tp(
    target: str,
    tp: int,
    shapes,
    reps: int,
    workdir: Path,
    info,
    engine: str = "sglang",
    in_flight: int = 1,
    put_clients: int = 1,
    breakdown: bool = False,
    transport: str = "mooncake",
    ipc_pool_gib: float = 8.0,
    aux_ids: list[int] | None = None,
    start_timeout_s: float = SERVER_START_TIMEOUT_S,
    mem_fraction_static: float = 0.5,
) -> dict:
    from specforge_kimi.run import services
    from specforge_kimi.run.offline_twin import capture_tools
    from specforge_kimi.servers.capture_server import capture_server_env

    aux_ids = AUX_IDS if aux_ids is None else aux_ids
    port, *mc_ports = services.free_ports(4)  # drawn together: a port drawn alone can come back for the master
    longest = max(length for _, length in shapes)
    result: dict = {"tp": tp, "put_clients": put_clients, "transport": transport}
    tag = (
        f"tp{tp}"
        + (f"-put{put_clients}" if put_clients > 1 else "")
        + (f"-{transport}" if transport != "mooncake" else "")
    )
    ipc_dir = workdir / f"ipc-{tag}"
    with services.mooncake_master(workdir / f"mooncake-{tag}.log", segment_bytes=16 << 30, ports=mc_ports) as mc:
        argv = _server_argv(target, engine, tp, port, longest, aux_ids, mem_fraction_static)
        env = {
            **capture_server_env(mc, cuda_visible_devices=list(range(tp)), put_clients=put_clients),
            "SGLANG_SPEC_CAPTURE_TIMING": "1",
        }
        ipc_store = None
        if transport == "cuda_ipc":
            from specforge_kimi.transport.store import CudaIpcFeatureStore

            env.update(
                SGLANG_SPEC_CAPTURE_TRANSPORT="cuda_ipc",
                SGLANG_SPEC_CAPTURE_IPC_POOL_BYTES=str(int(ipc_pool_gib * (1 << 30))),
                SGLANG_SPEC_CAPTURE_IPC_DIR=str(ipc_dir),
            )
            device = "cpu" if engine == "reference" else "cuda:0"  # the reference server's pool is shared memory
            ipc_store = CudaIpcFeatureStore(store_id=f"bench-{tag}", pool_dir=ipc_dir, device=device)
        log = workdir / f"server-{tag}.log"
        t = time.time()
        with services.server(argv, env, log, port, timeout_s=start_timeout_s) as proc:
            result["server_start_s"] = round(time.time() - t, 1)
            result["server_argv"] = argv
            url = f"http://127.0.0.1:{port}"
            adapter, cfg, store, _layout = capture_tools(
                url,
                mc,
                aux_ids=aux_ids,
                hidden=info.hidden_size,
                vocab=info.vocab_size,
                run_id=f"bench-{tag}",
                store=ipc_store,
            )
            result["shapes"] = [
                bench_shape(url, adapter, cfg, store, n, length, reps, log, transport) for n, length in shapes
            ]
            result["server_gpu_mib"] = _gpu_mib(services.group_pids(proc.pid))
            if transport == "cuda_ipc":
                pool = json.loads(next(ipc_dir.glob("*.json")).read_text())
                result["pool"] = {k: pool.get(k) for k in ("pool_id", "backend", "nbytes", "device", "alloc_conf")}
                result["reader"] = store.health()
            _extra_rounds(url, (adapter, cfg, store), result["shapes"], shapes, reps, log, in_flight, breakdown)
    if transport == "cuda_ipc":
        from specforge_kimi.transport.pool import remove_stale

        result["stale_pools_removed"] = remove_stale(ipc_dir)  # the stopped server's pool file and slot table
    return result


def _gpu_mib(pids) -> dict:
    """nvidia-smi's used GPU memory (MiB) of each of ``pids`` that holds any."""
    import subprocess

    try:
        res = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return {}
    out = {}
    for line in res.stdout.splitlines():
        pid, _, mib = line.partition(",")
        if pid.strip().isdigit() and int(pid) in set(pids):
            out[pid.strip()] = int(mib.strip() or 0)
    return out


def transport_comparison(runs: list[dict]) -> list[dict]:
    """Per TP size and shape, each transport's capture/plain and read rate side by side (runs with one put client)."""
    rows: dict = {}
    for run in runs:
        if run.get("error") or run.get("put_clients", 1) != 1:
            continue
        for sh in run.get("shapes") or []:
            key = (run["tp"], f"{sh['batch']}x{sh['tokens_per_prompt']}")
            rows.setdefault(key, {})[run.get("transport", "mooncake")] = {
                "capture_over_plain": sh["capture_over_plain"],
                "plain_tokens_per_s": sh["plain_tokens_per_s"],
                "read_gb_per_s": sh["read_gb_per_s"],
                "features_sha256": sh.get("features_sha256"),
                "server_gpu_mib": sum((run.get("server_gpu_mib") or {}).values()) or None,
                "pool_bytes": (run.get("pool") or {}).get("nbytes"),
            }
    out = []
    for (tp, shape), by in sorted(rows.items()):
        row = {"tp": tp, "shape": shape, **by}
        if "mooncake" in by and "cuda_ipc" in by:
            row["read_rate_cuda_ipc_over_mooncake"] = by["cuda_ipc"]["read_gb_per_s"] / by["mooncake"]["read_gb_per_s"]
            hashes = (by["mooncake"]["features_sha256"], by["cuda_ipc"]["features_sha256"])
            row["features_hash_equal"] = None if None in hashes else hashes[0] == hashes[1]
        out.append(row)
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", required=True)
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    p.add_argument("--shapes", default="64x1024,16x4096")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument(
        "--in-flight",
        type=int,
        default=1,
        help="also time K batches in flight per shape (K > 1), as producer_concurrency: K would send",
    )
    p.add_argument(
        "--put-clients",
        type=int,
        nargs="+",
        default=[1],
        help="capture sink store clients (our SGLang patch spec-capture-parallel-put); one server run per TP size and value",
    )
    p.add_argument(
        "--breakdown",
        action="store_true",
        help="also split a capture call's time: capture mode, feature sink, passthrough lists, client",
    )
    p.add_argument(
        "--compact-passthrough",
        action="store_true",
        help="the producer calls (capture, in-flight) send passthrough compactly, as a recipe with "
        "server.compact_passthrough: true does (our SpecForge compact-capture-passthrough + SGLang spec-capture-compact-passthrough; refused if missing)",
    )
    p.add_argument(
        "--transport",
        default="mooncake",
        help="comma-separated feature transports to measure, each on its own server: mooncake, cuda_ipc",
    )
    p.add_argument("--ipc-pool-gib", type=float, default=8.0, help="the cuda_ipc server's pool (GiB)")
    p.add_argument(
        "--run-report",
        nargs="+",
        default=None,
        help="online_run.json from specforge-kimi run-report; TRANSPORT=PATH (e.g. cuda_ipc=runs/x.json) names "
        "the transport its run used (a bare path: mooncake)",
    )
    p.add_argument("--workdir", default="/tmp/online-pipeline-bench")
    p.add_argument(
        "--engine",
        choices=("sglang", "reference"),
        default="sglang",
        help="reference = the CPU stand-in server (a dry run of this script, not a measurement)",
    )
    p.add_argument("--aux-ids", default=None, help="SpecForge aux layer ids, comma-separated (default 1,3,4)")
    p.add_argument("--server-start-timeout", type=float, default=SERVER_START_TIMEOUT_S, help="seconds to /health")
    p.add_argument(
        "--mem-fraction-static",
        type=float,
        default=0.5,
        help="the capture server's --mem-fraction-static (a recipe's server.mem_fraction_static: a target whose weights "
        "fill more of the GPU than the default leaves no KV cache)",
    )
    p.add_argument("--out", required=True)
    return p


class Settings(NamedTuple):
    """The flags, checked: what ``measure`` runs and ``write`` records (a named tuple: the tests load this
    script by path, outside ``sys.modules``, where a dataclass cannot resolve its annotations)."""

    target: str
    tps: list[int]
    shapes_text: str
    reps: int
    in_flight: int
    put_clients: list[int]
    breakdown: bool
    compact_passthrough: bool
    transports: list[str]
    ipc_pool_gib: float
    run_reports: dict[str, str]  # transport -> online_run.json
    workdir: Path
    engine: str
    aux_ids: list[int]
    server_start_timeout_s: float
    mem_fraction_static: float
    out: Path

    @property
    def shapes(self) -> list[tuple[int, ...]]:
        return [tuple(int(x) for x in s.split("x")) for s in self.shapes_text.split(",")]


def parse(argv=None) -> Settings:
    """The command line as ``Settings``; a bad flag ends in argparse's usage error (exit 2)."""
    p = _parser()
    args = p.parse_args(argv)
    aux_ids = AUX_IDS
    if args.aux_ids:
        from specforge_kimi.targets.layer_ids import parse_id_list

        aux_ids = list(parse_id_list(args.aux_ids, "--aux-ids"))
    if args.in_flight < 1:
        p.error("--in-flight must be >= 1")
    if min(args.put_clients) < 1:
        p.error("--put-clients must be >= 1")
    if not 0 < args.mem_fraction_static < 1:
        p.error("--mem-fraction-static must be between 0 and 1")
    transports = [t.strip() for t in args.transport.split(",") if t.strip()]
    if not transports or any(t not in TRANSPORTS for t in transports):
        p.error(f"--transport takes a comma-separated subset of {', '.join(TRANSPORTS)}")
    if args.compact_passthrough:
        from specforge_kimi.setup.setup_patches import compact_passthrough_gaps

        gaps = compact_passthrough_gaps(sglang=args.engine == "sglang")  # the reference engine takes them as is
        if gaps:
            p.error("--compact-passthrough: " + "; ".join(gaps))
    reports = {}
    for item in args.run_report or []:
        transport, sep, path = item.partition("=")
        if not sep or transport not in TRANSPORTS:
            transport, path = "mooncake", item
        reports[transport] = path
    return Settings(
        target=args.target,
        tps=args.tp,
        shapes_text=args.shapes,
        reps=args.reps,
        in_flight=args.in_flight,
        put_clients=args.put_clients,
        breakdown=args.breakdown,
        compact_passthrough=args.compact_passthrough,
        transports=transports,
        ipc_pool_gib=args.ipc_pool_gib,
        run_reports=reports,
        workdir=Path(args.workdir),
        engine=args.engine,
        aux_ids=aux_ids,
        server_start_timeout_s=args.server_start_timeout,
        mem_fraction_static=args.mem_fraction_static,
        out=Path(args.out),
    )


def _document(s: Settings, info) -> dict:
    """The result document before any run: the command, versions, environment and the run's configuration."""
    import torch

    from specforge_kimi.provenance import versions

    return {
        "command": [sys.executable, *sys.argv],
        "engine": s.engine,
        "versions": versions(),
        "environment": {
            "platform": platform.platform(),
            "gpu": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
            "cpu_count": os.cpu_count(),
        },
        "config": {
            "target": s.target,
            "layers": info.num_layers,
            "hidden": info.hidden_size,
            "quantization": info.quantization or "bf16",  # the routed experts' format (targets.checkpoint)
            "aux_specforge_ids": s.aux_ids,
            "shapes": s.shapes_text,
            "reps": s.reps,
            "in_flight": s.in_flight,
            "put_clients": s.put_clients,
            "transports": s.transports,
            "ipc_pool_gib": s.ipc_pool_gib if "cuda_ipc" in s.transports else None,
            "breakdown": s.breakdown,
            "compact_passthrough": s.compact_passthrough,
            "server_max_pending_capture_batches": int(os.environ.get("SGLANG_SPEC_CAPTURE_MAX_PENDING_BATCHES", "2")),
            "mooncake_protocol": "tcp (loopback)",
            "allreduce_fusion": False,
            "attention_backend": "triton",
            "cuda_graph": False,
            "mem_fraction_static": s.mem_fraction_static,
        },
        "baseline_capture_over_plain": {
            "what": "upstream path on the same box (issue 4): capture/plain prefill",
            "tp1": {"64x1024": 0.55, "16x4096": 0.91},
            "tp2": {"64x1024": 0.79, "16x4096": 0.92},
        },
        "runs": [],
    }


def _online_run(out: dict, transport: str, path: str) -> dict:
    """One run-report's rates beside this bench's capture rate at TP 2: which stage is slowest, and how close."""
    rep = json.loads(Path(path).read_text())
    perf = rep.get("perf", {})
    online = {
        "source": path,
        "transport": transport,
        "perf": perf,
        "gpu_memory": rep.get("gpu_memory"),
        "ledger": rep.get("ledger"),
        "metadata_bytes_per_trained_token": rep.get("metadata_bytes_per_trained_token"),
    }
    caps = [
        s["capture_tokens_per_s"]
        for r in out["runs"]
        if r.get("tp") == 2 and r.get("transport", "mooncake") == transport
        for s in r.get("shapes", [])
    ]
    stages = {
        k: v
        for k, v in {
            "trainer_only_tokens_per_s": perf.get("trainer_only_tokens_per_s"),
            "capture_tokens_per_s_tp2_min": min(caps) if caps else None,
        }.items()
        if v
    }
    if perf.get("end_to_end_tokens_per_s") and stages:
        online["slowest_stage"] = min(stages, key=stages.get)
        online["end_to_end_over_slowest_stage"] = perf["end_to_end_tokens_per_s"] / min(stages.values())
    return online


def measure(s: Settings) -> dict:
    """One server run per TP size, transport and put-client count (written after each), then the run reports."""
    import specforge_kimi
    from specforge_kimi.targets.checkpoint import inspect_target

    specforge_kimi.register()
    if s.compact_passthrough:
        from specforge_kimi.servers.capture_server import COMPACT_PASSTHROUGH_ENV

        os.environ[COMPACT_PASSTHROUGH_ENV] = "1"
    info = inspect_target(s.target)
    shapes = s.shapes
    s.workdir.mkdir(parents=True, exist_ok=True)
    out = _document(s, info)
    for tp in s.tps:
        for transport in s.transports:
            # put clients split Mooncake puts: a cuda_ipc server runs once per TP size
            for clients in s.put_clients if transport == "mooncake" else [1]:
                try:
                    out["runs"].append(
                        run_tp(
                            s.target,
                            tp,
                            shapes,
                            s.reps,
                            s.workdir,
                            info,
                            s.engine,
                            s.in_flight,
                            clients,
                            s.breakdown,
                            transport,
                            s.ipc_pool_gib,
                            aux_ids=s.aux_ids,
                            start_timeout_s=s.server_start_timeout_s,
                            mem_fraction_static=s.mem_fraction_static,
                        )
                    )
                except Exception as exc:  # record and go on with the next run
                    out["runs"].append(
                        {
                            "tp": tp,
                            "put_clients": clients,
                            "transport": transport,
                            "error": f"{type(exc).__name__}: {exc}",
                        }
                    )
                out["transport_comparison"] = transport_comparison(out["runs"])
                write(s, out)
    for transport, path in s.run_reports.items():
        if not Path(path).is_file():
            continue
        online = _online_run(out, transport, path)
        out.setdefault("online_runs", {})[transport] = online
        if transport == "mooncake" or "online_run" not in out:
            out["online_run"] = online  # what bench/report.py reads
    return out


def write(s: Settings, out: dict) -> None:
    """The document at ``--out``."""
    s.out.write_text(json.dumps(out, indent=2))


def _print_shape(r: dict, s: dict) -> None:
    print(
        f"tp{r['tp']} {r.get('transport', 'mooncake')} put clients {r.get('put_clients', 1)} "
        f"{s['batch']}x{s['tokens_per_prompt']}: plain {s['plain_tokens_per_s']:.0f} tok/s, "
        f"capture {s['capture_tokens_per_s']:.0f} tok/s, ratio {s['capture_over_plain']:.2f}, "
        f"{s['feature_bytes_per_token']:.0f} B/token, write {s['capture_write_gb_per_s']:.2f} GB/s, "
        f"read {s['read_gb_per_s']:.2f} GB/s"
    )
    if "breakdown" in s:
        b = s["breakdown"]
        print(
            "  breakdown (median ms): "
            + ", ".join(f"{v} encode {m['encode_ms']:.1f} post {m['post_ms']:.1f}" for v, m in b["variants"].items())
            + (f"; errors {b['errors']}" if b["errors"] else "")
        )
        for k, v in (b.get("attribution_ms") or {}).items():
            print(f"    {k}: {v:.1f} ms")
        if b["producer_minus_full_ms"] is not None:
            print(f"    producer_minus_full: {b['producer_minus_full_ms']:.1f} ms")
    if "in_flight" in s:
        f = s["in_flight"]
        print(
            f"  {f['in_flight']} in flight: plain {f['plain_tokens_per_s']:.0f} tok/s, capture "
            f"{f['capture_tokens_per_s']:.0f} tok/s, ratio {f['capture_over_plain']:.2f}"
        )


def print_summary(out: dict) -> None:
    """One line per run and shape (with its breakdown and in-flight lines), then the transports side by side."""
    for r in out["runs"]:
        for s in r.get("shapes", []):
            _print_shape(r, s)
        if "error" in r:
            print(f"tp{r['tp']} {r.get('transport', 'mooncake')}: {r['error']}")
    for row in out.get("transport_comparison") or []:
        if "read_rate_cuda_ipc_over_mooncake" in row:
            print(
                f"tp{row['tp']} {row['shape']}: capture/plain mooncake {row['mooncake']['capture_over_plain']:.2f}, "
                f"cuda_ipc {row['cuda_ipc']['capture_over_plain']:.2f}; read cuda_ipc / mooncake "
                f"{row['read_rate_cuda_ipc_over_mooncake']:.1f}x; features hash equal: {row['features_hash_equal']}"
            )


def main(argv=None) -> int:
    settings = parse(argv)
    out = measure(settings)
    write(settings, out)
    print_summary(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
