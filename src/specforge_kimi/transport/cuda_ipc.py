"""The ``cuda_ipc`` strategy: features stay on the GPU, in one pool the capture server owns on GPU 0 of the node,
mapped by CUDA IPC by every trainer rank (:mod:`specforge_kimi.transport`).

Refused (one line each, naming why): more than one node (IPC handles do not cross hosts), SGLang DP attention
(one capture writer per DP group, one pool each: not supported), capture-server restarts and the segment keeper
(the pool dies with its server, and the features of unacknowledged samples with it; Mooncake with
``segment_owner: keeper`` survives a restart), Mooncake put clients (a Mooncake knob), and a pool too small for one
optimizer window plus what the producer may have in flight. GPUs without peer access are a property of the host:
the launch's preflight and ``doctor`` check them (:func:`peer_access_problem`).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from specforge_kimi.environment import CLONE_ON_FETCH
from specforge_kimi.transport import (
    LEASE_ENV,
    POOL_BYTES_ENV,
    POOL_DIR_ENV,
    READER_DIR_ENV,
    SERVER_TRANSPORT_ENV,
    TRANSPORT_ENV,
)
from specforge_kimi.transport.pool import remove_stale
from specforge_kimi.transport.strategy import GIB, FeatureSizing, Finding, store_refusal

#: SGLang's flags that turn DP attention on (one capture writer per DP group)
DP_FLAGS = ("--enable-dp-attention", "--dp-size", "--dp", "--data-parallel-size")
#: SpecForge's loader clones every fetched tensor unless told not to; our store's ``get`` returns fresh ones
CLONE_ON_FETCH_ENV = CLONE_ON_FETCH.name


def ipc_dir(output_dir: str) -> str:
    """Where a run's pool files go: ``<output_dir>/ipc``."""
    return str(Path(output_dir) / "ipc")


class CudaIpc:
    name = "cuda_ipc"
    runs_mooncake_master = False
    sglang_patch = "spec-capture-cuda-ipc"

    def refusal(self, r, s: FeatureSizing) -> str | None:
        server, res = r.server, r.resilience
        if r.gpus.nnodes > 1:
            return (
                "server.transport cuda_ipc is single-node: CUDA IPC handles do not cross hosts and trainer ranks of "
                "other nodes could not map the pool; use mooncake"
            )
        dp = [a for a in server.extra_args if a.split("=")[0] in DP_FLAGS]
        if dp:
            return (
                f"server.transport cuda_ipc does not support SGLang DP attention ({dp[0]} in server.extra_args): "
                "each DP group would write its own pool; use mooncake"
            )
        if res.server_restarts:
            return (
                "server.transport cuda_ipc cannot restart a lost capture server (resilience.server_restarts): the "
                "features of unacknowledged samples live in the lost server's GPU pool; use mooncake with "
                "segment_owner: keeper for that"
            )
        if res.segment_owner != "server":
            return "resilience.segment_owner: keeper keeps a Mooncake segment; server.transport cuda_ipc has none"
        if server.capture_put_clients > 1:
            return "server.capture_put_clients splits Mooncake puts; with server.transport cuda_ipc leave it at 1"
        gib = server.ipc_pool_gib
        return store_refusal(f"server.ipc_pool_gib {gib:g}" if gib is not None else "the sized pool", s.pool_bytes, s)

    def store_bytes(self, s: FeatureSizing) -> int:
        return s.pool_bytes

    def memory_terms(self, s: FeatureSizing) -> dict[str, int]:
        return {"pool": s.pool_bytes, "server_rows": s.server_rows_bytes, "prefetch": s.prefetch_bytes}

    def memory_report(self, s: FeatureSizing, writer_room_gib: float) -> dict[str, float]:
        return {
            "ipc_pool_gib": round(s.pool_bytes / GIB, 2),
            "server_capture_rows_gib": round(s.server_rows_bytes / GIB, 2),
            "trainer_ipc_prefetch_gib": round(s.prefetch_bytes / GIB, 2),
            "writer_gpu_trainer_room_gib": round(writer_room_gib, 2),
        }

    def server_env(self, r, s: FeatureSizing) -> dict[str, str]:
        return {
            SERVER_TRANSPORT_ENV: self.name,
            POOL_BYTES_ENV: str(s.pool_bytes),
            POOL_DIR_ENV: ipc_dir(r.output_dir),
            LEASE_ENV: str(r.server.ipc_lease_s),
        }

    def process_env(self, r) -> dict[str, str]:
        return {TRANSPORT_ENV: self.name, READER_DIR_ENV: ipc_dir(r.output_dir), CLONE_ON_FETCH_ENV: "0"}

    def why_chosen(self, s: FeatureSizing) -> str | None:
        return (
            "one node, capture server and trainer ranks co-located: features stay on the GPU, copied device to "
            f"device through a {s.pool_bytes / GIB:.2f} GiB pool on GPU 0 (docs/online.md 'Feature transports')"
        )

    def preflight(self, gpus: str, patch_gaps: list[str]) -> list[str]:
        if patch_gaps:
            return [
                "server.transport is cuda_ipc, but " + "; ".join(patch_gaps) + ". Run specforge-kimi setup "
                "--specforge-checkout /path/to/SpecForge, or set server.transport: mooncake in the recipe"
            ]
        problem = peer_access_problem(gpus)
        return [problem] if problem else []

    def doctor_findings(self, r, s: FeatureSizing, gpus: str, patch_gaps: list[str]) -> list[Finding]:
        problems = list(patch_gaps)
        if not problems:
            peer = peer_access_problem(gpus)
            problems = [peer] if peer else []
        many = len([g for g in gpus.split(",") if g.strip()]) > 1
        detail = "; ".join(problems) or (
            f"SGLang patch {self.sglang_patch} applied; pool {s.pool_bytes / GIB:.2f} GiB on GPU 0"
            + (", every GPU reaches it by peer access" if many else "")
        )
        fix = "specforge-kimi setup --specforge-checkout /path/to/SpecForge, or server.transport: mooncake"
        return [Finding("cuda_ipc transport", "fail" if problems else "ok", detail, fix if problems else "")]

    def remove_stale(self, output_dir: str) -> list[str]:
        return remove_stale(ipc_dir(output_dir))


CUDA_IPC = CudaIpc()


def feature_store_for(env, run_id: str, *, retain_on_release: bool):
    """Our ``FeatureStore`` when the SpecForge process's environment names this transport, else None."""
    if env.get(TRANSPORT_ENV) != CUDA_IPC.name:
        return None
    from specforge_kimi.transport.store import CudaIpcFeatureStore  # torch and SpecForge: only when asked

    return CudaIpcFeatureStore.from_env(
        store_id=env.get("DISAGG_STORE_ID", run_id), retain_on_release=retain_on_release
    )


def wants_pool(capture_spec: dict) -> bool:
    """Whether a capture request names this transport (``spec_capture.transport``)."""
    return capture_spec.get("transport") == CUDA_IPC.name


def peer_access_problem(cuda_visible_devices: str, python: str | None = None) -> str | None:
    """With more than one GPU listed, whether every one reaches the first (the pool's) by peer access; asked in
    a child process so this one creates no CUDA context. None when fine (or one GPU)."""
    gpus = [g for g in cuda_visible_devices.split(",") if g.strip()]
    if len(gpus) < 2:
        return None
    code = (
        "import torch; n = torch.cuda.device_count(); "
        "print(','.join(str(i) for i in range(1, n) if not torch.cuda.can_device_access_peer(i, 0)) + '|' + str(n))"
    )
    res = subprocess.run(
        [python or sys.executable, "-c", code],
        env={**os.environ, "CUDA_VISIBLE_DEVICES": cuda_visible_devices},
        capture_output=True,
        text=True,
        timeout=120,
    )
    if res.returncode != 0:
        return f"server.transport cuda_ipc: could not check peer access between the GPUs: {res.stderr.strip()[-300:]}"
    lines = res.stdout.strip().splitlines()
    bad, _, count = (lines[-1] if lines else "").partition("|")
    if count != str(len(gpus)):
        return f"server.transport cuda_ipc: {count} of the {len(gpus)} GPUs {cuda_visible_devices} are visible to torch"
    if bad:
        return (
            f"server.transport cuda_ipc: GPU(s) {bad} of CUDA_VISIBLE_DEVICES={cuda_visible_devices} cannot reach GPU 0 "
            "(the capture writer's pool) by peer access; use mooncake"
        )
    return None
