"""Issue 25 on one GPU: features read through the cuda_ipc transport equal those read through Mooncake, bit for
bit, on the same prompts, with the real stack (SGLang + SpecForge's capture patch + our SGLang patches, SpecForge's
producer adapter, our store mapping the server's pool by CUDA IPC in this second process).

One capture server (a random-weight tiny K2.5: 8 layers, hidden 512; TP=1, triton attention,
``--enable-deterministic-inference`` so two prefills of the same batch are the same bits) runs on the cuda_ipc
transport with a Mooncake master beside it; the same prompts (lengths 16-2000, several per request) are
captured three times through SpecForge's ``SGLangServerCaptureAdapter``: to Mooncake (a request naming
``transport: mooncake``), to the pool, to Mooncake again. Checks: the two Mooncake reads are equal (the prefill
is deterministic, so any difference below is the transport's), every feature of every sample read from the
pool equals its Mooncake read (``torch.equal``), pool reads land on the reader's GPU, and a release written at
``abort`` is what the slot table shows. After the server stops: no compute process but this one (which mapped
the pool) is left on the GPU (nvidia-smi). Writes ``cuda_ipc_bitwise.json`` (per-sample equality, pool facts, read rates as information) and
the server log under ``$SPECFORGE_KIMI_GPU_OUT``. Expected wall time on one H200: ~2 minutes (a ~60 s server
start, seconds of captures).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]
SPEC = dict(layers=8, hidden=512, heads=8, experts=8, experts_per_token=2, moe_intermediate=256, seed=0)
AUX_IDS = [1, 3, 4]
#: requests of several prompts each (the sink writes a scheduler batch at once)
BATCHES = ((16, 17, 100, 513), (1024, 1000), (2000,), (31, 255, 256, 257, 300, 777))
POOL_BYTES = 2 << 30


def _compute_apps() -> list[str]:
    """nvidia-smi's compute processes other than this one (which maps the pool and reads on the GPU)."""
    out = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader"],
        capture_output=True,
        text=True,
    )
    return [line for line in out.stdout.splitlines() if line.strip() and line.split(",")[0].strip() != str(os.getpid())]


def _with_transport(adapter, transport: str):
    """Requests of this adapter name ``transport`` (spec-capture-cuda-ipc: one server answers both)."""
    payload = adapter._spec_capture_payload
    adapter._spec_capture_payload = lambda task: {**payload(task), "transport": transport}
    return adapter


def test_cuda_ipc_reads_equal_mooncake_reads_bit_for_bit(tmp_path):
    import torch

    import specforge_kimi
    from specforge_kimi.run import services
    from specforge_kimi.run.offline_twin import capture_tools
    from specforge_kimi.servers.capture_server import capture_server_argv, capture_server_env
    from specforge_kimi.targets.tiny import TinySpec, write_tiny
    from specforge_kimi.transport.pool import remove_stale
    from specforge_kimi.transport.slots import SlotTable
    from specforge_kimi.transport.store import CudaIpcFeatureStore

    out = Path(os.environ.get("SPECFORGE_KIMI_GPU_OUT") or tempfile.mkdtemp(prefix="cuda-ipc-"))
    out.mkdir(parents=True, exist_ok=True)
    specforge_kimi.register()
    target = write_tiny(tmp_path / "k25", TinySpec(**SPEC))
    ipc_dir = tmp_path / "ipc"
    port, *mc_ports = services.free_ports(4)  # drawn together, so the master cannot get the server's port
    gen = torch.Generator().manual_seed(25)
    prompts = [[torch.randint(0, 163584, (n,), generator=gen).tolist() for n in batch] for batch in BATCHES]
    summary: dict = {"batches": [list(b) for b in BATCHES], "samples": []}
    log = out / "cuda_ipc_server.log"
    before = _compute_apps()
    with services.mooncake_master(tmp_path / "mooncake.log", segment_bytes=4 << 30, ports=mc_ports) as mc:
        argv = capture_server_argv(
            target,
            tp=1,
            port=port,
            aux_specforge_ids=AUX_IDS,
            fusion=False,
            attention_backend="triton",
            mem_fraction_static=0.3,
            context_length=2304,
            disable_cuda_graph=True,
            python=sys.executable,
            extra=["--enable-deterministic-inference"],
        )
        env = {
            **capture_server_env(mc, cuda_visible_devices=[0]),
            "SGLANG_SPEC_CAPTURE_TRANSPORT": "cuda_ipc",
            "SGLANG_SPEC_CAPTURE_IPC_POOL_BYTES": str(POOL_BYTES),
            "SGLANG_SPEC_CAPTURE_IPC_DIR": str(ipc_dir),
            "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")]),
        }
        t0 = time.time()
        with services.server(argv, env, log, port, timeout_s=420):
            summary["server_start_s"] = round(time.time() - t0, 1)
            url = f"http://127.0.0.1:{port}"
            kw = dict(aux_ids=AUX_IDS, hidden=SPEC["hidden"], vocab=163840, run_id="bitwise")
            mc_adapter, cfg, mc_store, _ = capture_tools(url, mc, **kw)
            _with_transport(mc_adapter, "mooncake")
            ipc_store = CudaIpcFeatureStore(store_id="bitwise", pool_dir=ipc_dir, device="cuda:0")
            ipc_adapter, _, _, _ = capture_tools(url, mc, **kw, store=ipc_store)
            (pool_file,) = ipc_dir.glob("*.json")
            pool = json.loads(pool_file.read_text())
            summary["pool"] = {k: pool[k] for k in ("pool_id", "backend", "nbytes", "lease_s", "device", "alloc_conf")}
            from specforge.inference.adapters.server_capture import ServerCaptureFailure
            from specforge.runtime.contracts import PromptTask

            def capture(adapter, tag, ids_batch):
                tasks = [
                    PromptTask(
                        task_id=f"{tag}-{i}",
                        run_id="bitwise",
                        source_id="gpu-test",
                        payload={"input_ids": ids, "loss_mask": [1] * len(ids)},
                        max_length=len(ids) + 1,
                        metadata={"num_tokens": len(ids)},
                    )
                    for i, ids in enumerate(ids_batch)
                ]
                refs = adapter.produce_refs(tasks, capture=cfg)
                bad = [r for r in refs if isinstance(r, ServerCaptureFailure)]
                assert not bad, bad[0].reason
                return refs

            read_s = {"mooncake": 0.0, "cuda_ipc": 0.0}
            read_bytes = 0
            for b, batch in enumerate(prompts):
                first = capture(mc_adapter, f"m1-{b}", batch)
                pooled = capture(ipc_adapter, f"ipc-{b}", batch)
                again = capture(mc_adapter, f"m2-{b}", batch)
                assert all(r.feature_store_uri.startswith("cudaipc://") for r in pooled)
                assert all(r.feature_store_uri.startswith("mooncake://") for r in first + again)
                for ids, r1, rp, r2 in zip(batch, first, pooled, again, strict=True):
                    t = time.perf_counter()
                    m1, h1 = mc_store.get(r1)
                    read_s["mooncake"] += time.perf_counter() - t
                    m2, _ = mc_store.get(r2)
                    t = time.perf_counter()
                    p, hp = ipc_store.get(rp)
                    read_s["cuda_ipc"] += time.perf_counter() - t
                    read_bytes += sum(v.numel() * v.element_size() for v in m1.values())
                    assert set(p) == set(m1) == set(m2)
                    assert all(v.device == torch.device("cuda", 0) for v in p.values())
                    row = {
                        "tokens": len(ids),
                        "deterministic_prefill": all(torch.equal(m1[n], m2[n]) for n in m1),
                        "cuda_ipc_equals_mooncake": {n: torch.equal(p[n].cpu(), m1[n]) for n in m1},
                    }
                    summary["samples"].append(row)
                    slot, alloc = rp.metadata["cuda_ipc"]["slot"], rp.metadata["cuda_ipc"]["alloc"]
                    table = SlotTable.attach(pool["slots_path"])
                    assert table.current(slot) == alloc and table.row(slot)["release"] != alloc
                    ipc_store.abort(rp.sample_id, reason="test")  # what the optimizer-step ack does
                    assert table.row(slot)["release"] == alloc
                    for ref in (r1, r2):
                        mc_store.abort(ref.sample_id, reason="test")
            (out / "cuda_ipc_bitwise.json").write_text(json.dumps(summary, indent=1))
            summary["read_gb_per_s_information"] = {k: read_bytes / v / 1e9 for k, v in read_s.items() if v}
            summary["ipc_store_health"] = ipc_store.health()
            ipc_store.close()
            del p, m1, m2
            torch.cuda.empty_cache()
    time.sleep(5)
    after = _compute_apps()
    summary["compute_apps_before"], summary["compute_apps_after"] = before, after
    summary["stale_pools_removed"] = remove_stale(ipc_dir)
    (out / "cuda_ipc_bitwise.json").write_text(json.dumps(summary, indent=1, default=str))
    assert all(s["deterministic_prefill"] for s in summary["samples"]), "two Mooncake captures differ: not comparable"
    bad = [s for s in summary["samples"] if not all(s["cuda_ipc_equals_mooncake"].values())]
    assert not bad, bad
    assert len(summary["samples"]) == sum(len(b) for b in BATCHES)
    assert not after, after  # the server's processes, and with them its pool, are gone
