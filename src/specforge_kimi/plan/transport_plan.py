"""What each feature transport asks of a recipe: where ``server.transport: cuda_ipc`` cannot work, its pool's
size, the producer's byte watermarks (both transports), the GPU memory it takes, and the environment of each role.

Scope: the recipe side of :mod:`specforge_kimi.transport`. Refused (one line each, naming why): more than one
node (IPC handles do not cross hosts), SGLang DP attention (one capture writer per DP group, one pool each:
not supported), capture-server restarts and the segment keeper (the pool dies with its server, and the
features of unacknowledged samples with it; Mooncake with ``segment_owner: keeper`` survives a restart),
Mooncake put clients (a Mooncake knob), and a pool too small for one optimizer window plus what the producer
may have in flight. GPUs without peer access are a property of the host: ``launch`` checks them.

Sizing. A sample of ``max_length`` tokens takes ``S = max_length x feature bytes per token`` in the pool
((aux layers + 1) x hidden x 2 B + 3 int64 passthrough). The consumer needs one whole optimizer window of
``Q = trainer ranks x batch x accumulation`` samples before it acknowledges (and releases) anything, and
SpecForge's producer overshoots its watermark by up to ``producer_concurrency x producer_lease`` samples
(defaults 1 x 8). So the pool must hold ``Q x S + 8 S``; the recipe's producer is given a resident-byte high
watermark of ``0.8 x pool - 8 S`` (low: 3/4 of it), so it pauses before the server's pool fills, and the
server's wait for space (backpressure) is a backstop. That minimum keeps the trainer fed only in bursts: every
rank's loader also holds its prefetched samples' slots (4 batches ahead), and a producer paused at one window
refills only once the pool has drained. ``ipc_pool_gib`` unset is therefore sized from the memory plan: room
for two optimizer windows plus every rank's prefetch under the watermark (plus the overshoot), capped at what
GPU 0 has left beside the server, its captured rows and the trainer's planned peak, never below the minimum;
rounded to a quarter GiB (at least 1 GiB), every sample counted at ``max_length``.

Which transport. ``server.transport: auto`` (the default) is ``cuda_ipc`` wherever the recipe passes every
check with it (one node, co-located, no DP attention, no server restarts or segment keeper, the pool fits on
GPU 0) and ``mooncake`` otherwise; :func:`choice` says which and why, and ``recipe validate`` prints it.

Mooncake. The same holds for the capture server's Mooncake segment (``mooncake.global_segment_gib``): its
features in flight live there until acknowledged, and SpecForge's default watermark counts refs only (256 high,
192 low), which at K2.5 width and 4k-token samples (235 MB each) is 60 GB -- more than the 32 GiB default
segment, and a put into a full segment fails (``BatchPut ... insufficient space``) and the producer's channel
with it (NOTES "Feature transports"). So a Mooncake recipe's producer gets the
byte watermark ``0.8 x segment - 8 S`` as well (SpecForge hard-pins every object it puts, so Mooncake cannot
evict one: a full segment fails the put; the 20% is room for the allocator's fragmentation), and a segment
smaller than the window plus the overshoot at 0.8 is refused.

GPU memory. The pool (on the writer's GPU, GPU 0 of the node) and, there too, up to
``SGLANG_SPEC_CAPTURE_MAX_PENDING_BATCHES`` (2) batches of captured rows the scheduler keeps on the GPU until
the sink has copied them (a batch is at most ``max(16384, max_length + 256)`` tokens: SGLang's
``max_prefill_tokens`` or the context length); on every rank the loader's prefetched samples (SpecForge's
eagle3 loader keeps 4 batches ahead), which Mooncake keeps on the host.
"""

from __future__ import annotations

from typing import Any

GIB = 1 << 30
PASSTHROUGH_BYTES_PER_TOKEN = 3 * 8  # input_ids, loss_mask, attention_mask (int64)
PRODUCER_OVERSHOOT_SAMPLES = 1 * 8  # SpecForge's runtime.producer_concurrency x producer_lease defaults
SERVER_PENDING_BATCHES = 2  # SGLANG_SPEC_CAPTURE_MAX_PENDING_BATCHES default
SGLANG_MAX_PREFILL_TOKENS = 16384  # SGLang 0.5.14's default --max-prefill-tokens
LOADER_PREFETCH_BATCHES = 4  # SpecForge's eagle3 default_dataloader_num_workers (prefetch depth)
WATERMARK_FRACTION = 0.8
_DP_FLAGS = ("--enable-dp-attention", "--dp-size", "--dp", "--data-parallel-size")


def feature_bytes_per_token(r) -> int:
    """Pool bytes per captured token: (aux layers + last hidden) x hidden x 2 B (bf16) + the passthrough."""
    return (len(r.target.aux_layer_ids) + 1) * r.target.hidden_size * 2 + PASSTHROUGH_BYTES_PER_TOKEN


def sample_bytes(r) -> int:
    return r.trainer.max_length * feature_bytes_per_token(r)


def optimizer_window(r) -> int:
    """Samples the consumer takes before it acknowledges: ranks x batch x accumulation (SpecForge's default 1)."""
    return r.gpus.per_node * r.gpus.nnodes * r.trainer.batch_size


def min_store_bytes(r) -> int:
    """The least a store of features in flight (the cuda_ipc pool, the Mooncake segment) may hold: one optimizer
    window plus the producer's overshoot, at the watermark fraction."""
    s = sample_bytes(r)
    return int((optimizer_window(r) * s + PRODUCER_OVERSHOOT_SAMPLES * s) / WATERMARK_FRACTION) + 1


def segment_bytes(r) -> int:
    """The Mooncake segment holding features in flight (the server's, or the keeper's: the same size)."""
    return int(r.mooncake.global_segment_gib * GIB)


def store_bytes(r) -> int:
    """Bytes the recipe's transport holds features in flight in: the pool (cuda_ipc) or the segment (mooncake)."""
    return pool_bytes(r) if r.server.transport == "cuda_ipc" else segment_bytes(r)


def wanted_pool_bytes(r) -> int:
    """The pool that keeps every trainer rank fed: two optimizer windows plus every rank's loader prefetch
    resident under the producer's watermark, plus its overshoot."""
    resident = 2 * optimizer_window(r) + LOADER_PREFETCH_BATCHES * r.trainer.batch_size * r.gpus.per_node
    return int((resident + PRODUCER_OVERSHOOT_SAMPLES) * sample_bytes(r) / WATERMARK_FRACTION) + 1


def server_rows_bytes(r) -> int:
    """Captured rows the scheduler keeps on the writer's GPU until the sink has copied them (cuda_ipc)."""
    captured = (len(r.target.aux_layer_ids) + 1) * r.target.hidden_size * 2
    return SERVER_PENDING_BATCHES * max(SGLANG_MAX_PREFILL_TOKENS, r.trainer.max_length + 256) * captured


def prefetch_bytes(r) -> int:
    """A trainer rank's prefetched samples on its GPU (cuda_ipc; Mooncake keeps them on the host)."""
    return LOADER_PREFETCH_BATCHES * r.trainer.batch_size * sample_bytes(r)


def pool_room_bytes(r) -> int:
    """What GPU 0 has left for the pool: the trainer's room beside the server's static pool, less the captured
    rows and the trainer's planned peak (``trainer_terms`` + prefetch + ``trainer.reserve_gib``)."""
    from specforge_kimi.plan.trainer_terms import trainer_peak_bytes, trainer_room_bytes

    return trainer_room_bytes(r) - server_rows_bytes(r) - trainer_peak_bytes(r, prefetch=prefetch_bytes(r))


def pool_bytes(r) -> int:
    """The pool's size: ``server.ipc_pool_gib``, or :func:`wanted_pool_bytes` capped at :func:`pool_room_bytes`
    and never below :func:`min_store_bytes`, in quarter GiB (>= 1 GiB)."""
    if r.server.ipc_pool_gib is not None:
        return int(r.server.ipc_pool_gib * GIB)
    quarter = GIB // 4
    floor = max(GIB, -(-min_store_bytes(r) // quarter) * quarter)
    wanted = -(-wanted_pool_bytes(r) // quarter) * quarter
    cap = max(0, pool_room_bytes(r)) // quarter * quarter
    return max(floor, min(wanted, cap))


def watermarks(r) -> tuple[int, int]:
    """SpecForge's ``runtime.resident_{high,low}_watermark_bytes`` for the producer, from :func:`store_bytes`."""
    high = int(WATERMARK_FRACTION * store_bytes(r)) - PRODUCER_OVERSHOOT_SAMPLES * sample_bytes(r)
    return high, int(0.75 * high)


def store_refusal(r) -> str | None:
    """Why the recipe's store of features in flight (:func:`store_bytes`: the cuda_ipc pool, the Mooncake
    segment) is too small for one optimizer window plus the producer's overshoot, or None."""
    need = min_store_bytes(r)
    if store_bytes(r) >= need:
        return None
    if r.server.transport == "cuda_ipc":
        setting = f"server.ipc_pool_gib {r.server.ipc_pool_gib:g}"
    else:
        setting = f"mooncake.global_segment_gib {r.mooncake.global_segment_gib:g}"
    return (
        f"{setting} is below the {need / GIB:.2f} GiB one optimizer window ({optimizer_window(r)} samples of up to "
        f"{sample_bytes(r) / GIB:.3f} GiB) plus the producer's {PRODUCER_OVERSHOOT_SAMPLES} in flight needs at a "
        f"{WATERMARK_FRACTION} watermark"
    )


def refusal(r) -> str | None:
    """Why ``server.transport: cuda_ipc`` cannot serve this recipe, or None."""
    s, res = r.server, r.resilience
    if r.gpus.nnodes > 1:
        return (
            "server.transport cuda_ipc is single-node: CUDA IPC handles do not cross hosts and trainer ranks of "
            "other nodes could not map the pool; use mooncake"
        )
    dp = [a for a in s.extra_args if a.split("=")[0] in _DP_FLAGS]
    if dp:
        return (
            f"server.transport cuda_ipc does not support SGLang DP attention ({dp[0]} in server.extra_args): each "
            "DP group would write its own pool; use mooncake"
        )
    if res.server_restarts:
        return (
            "server.transport cuda_ipc cannot restart a lost capture server (resilience.server_restarts): the "
            "features of unacknowledged samples live in the lost server's GPU pool; use mooncake with "
            "segment_owner: keeper for that"
        )
    if res.segment_owner != "server":
        return "resilience.segment_owner: keeper keeps a Mooncake segment; server.transport cuda_ipc has none"
    if s.capture_put_clients > 1:
        return "server.capture_put_clients splits Mooncake puts; with server.transport cuda_ipc leave it at 1"
    return store_refusal(r)


def memory_terms(r) -> dict[str, int]:
    """GPU bytes the transport adds: ``pool`` and ``server_rows`` on the writer's GPU, ``prefetch`` on every
    trainer rank's (all 0 for mooncake)."""
    if r.server.transport != "cuda_ipc":
        return {"pool": 0, "server_rows": 0, "prefetch": 0}
    return {"pool": pool_bytes(r), "server_rows": server_rows_bytes(r), "prefetch": prefetch_bytes(r)}


def choice(r) -> dict[str, str]:
    """The transport the recipe gets and why: ``{"transport", "chosen_by", "why"}`` (``chosen_by``: ``recipe``
    when ``server.transport`` names it, ``auto`` when the default picked it)."""
    chosen_by = r._transport_chosen_by
    if r.server.transport == "cuda_ipc":
        why = (
            "one node, capture server and trainer ranks co-located: features stay on the GPU, copied device to "
            f"device through a {pool_bytes(r) / GIB:.2f} GiB pool on GPU 0 (measured at K2.5 width: 0.97-0.99 of "
            "plain prefill, Mooncake 0.65-0.82)"
        )
    else:
        refused = r._transport_why or refusal_as_cuda_ipc(r)
        why = (
            ("cuda_ipc would be refused: " + refused.removeprefix("cuda_ipc would be refused: "))
            if refused
            else "named by the recipe (cuda_ipc would apply here too)"
        )
    return {"transport": r.server.transport, "chosen_by": chosen_by, "why": why}


def refusal_as_cuda_ipc(r) -> str | None:
    """Why this recipe would be refused with ``server.transport: cuda_ipc`` (the recipe checks, the memory
    split), or None."""
    from pydantic import ValidationError

    from specforge_kimi.errors import validation_summary

    raw = r.model_dump()
    raw["server"]["transport"] = "cuda_ipc"
    try:
        type(r).model_validate(raw)
    except ValidationError as exc:
        return validation_summary(exc).removeprefix("Value error, ")
    return None


def runtime_config(r) -> dict[str, Any]:
    """The SpecForge ``runtime:`` section the transport needs: the producer's byte watermarks, so it pauses
    before the pool or the segment fills (refs alone do not bound bytes)."""
    high, low = watermarks(r)
    return {"resident_high_watermark_bytes": high, "resident_low_watermark_bytes": low}


def ipc_dir(r) -> str:
    from pathlib import Path

    return str(Path(r.output_dir) / "ipc")


def server_env(r) -> dict[str, str]:
    """The capture server's transport variables (empty for mooncake)."""
    from specforge_kimi import transport as t

    if r.server.transport != "cuda_ipc":
        return {}
    return {
        t.SERVER_TRANSPORT_ENV: "cuda_ipc",
        t.POOL_BYTES_ENV: str(pool_bytes(r)),
        t.POOL_DIR_ENV: ipc_dir(r),
        t.LEASE_ENV: str(r.server.ipc_lease_s),
    }


def process_env(r) -> dict[str, str]:
    """The producer's and trainer ranks' transport variables (empty for mooncake): our store, where pools are,
    and no defensive clone in SpecForge's loader (each ``get`` returns fresh tensors already)."""
    from specforge_kimi import transport as t

    if r.server.transport != "cuda_ipc":
        return {}
    return {t.TRANSPORT_ENV: "cuda_ipc", t.READER_DIR_ENV: ipc_dir(r), "CLONE_ON_FETCH": "0"}


def peer_access_problem(cuda_visible_devices: str, python: str | None = None) -> str | None:
    """With more than one GPU listed, whether every one reaches the first (the pool's) by peer access; asked in
    a child process so this one creates no CUDA context. None when fine (or one GPU)."""
    import os
    import subprocess
    import sys

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


def remove_stale_pools(r) -> list[str]:
    """What pools of dead capture servers left in the recipe's pool directory and ``/dev/shm``."""
    if r.server.transport != "cuda_ipc":
        return []
    from specforge_kimi.transport.pool import remove_stale

    return remove_stale(ipc_dir(r))
