"""A recipe's features in flight, sized: the bytes of a sample, the optimizer window, the cuda_ipc pool's size, the
producer's byte watermarks, what the transports' strategies read (:class:`~specforge_kimi.transport.strategy.
FeatureSizing`).

Scope: arithmetic on a recipe's sections. What each transport refuses and adds lives in its strategy
(:mod:`specforge_kimi.transport.cuda_ipc`, :mod:`specforge_kimi.transport.mooncake`); the plan asks them
(``plan.run_plan.choose_transport``).

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

Mooncake. The capture server's Mooncake segment (``mooncake.global_segment_gib``) holds the features in flight
the same way, so a Mooncake recipe's producer gets the byte watermark ``0.8 x segment - 8 S`` as well
(:mod:`specforge_kimi.transport.mooncake` says why).

GPU memory. The pool (on the writer's GPU, GPU 0 of the node) and, there too, up to
``SGLANG_SPEC_CAPTURE_MAX_PENDING_BATCHES`` (2) batches of captured rows the scheduler keeps on the GPU until
the sink has copied them (a batch is at most ``max(16384, max_length + SERVER_CONTEXT_MARGIN)`` tokens: SGLang's
``max_prefill_tokens`` or the context length); on every rank the loader's prefetched samples (SpecForge's
eagle3 loader keeps 4 batches ahead), which Mooncake keeps on the host.
"""

from __future__ import annotations

from typing import Any

from specforge_kimi.plan.inputs import SERVER_CONTEXT_MARGIN
from specforge_kimi.plan.trainer_terms import trainer_peak_bytes, trainer_room_bytes
from specforge_kimi.transport import registry
from specforge_kimi.transport.strategy import GIB, WATERMARK_FRACTION, FeatureSizing, Transport

PASSTHROUGH_BYTES_PER_TOKEN = 3 * 8  # input_ids, loss_mask, attention_mask (int64)
PRODUCER_OVERSHOOT_SAMPLES = 1 * 8  # SpecForge's runtime.producer_concurrency x producer_lease defaults
SERVER_PENDING_BATCHES = 2  # SGLANG_SPEC_CAPTURE_MAX_PENDING_BATCHES default
SGLANG_MAX_PREFILL_TOKENS = 16384  # SGLang 0.5.14's default --max-prefill-tokens
LOADER_PREFETCH_BATCHES = 4  # SpecForge's eagle3 default_dataloader_num_workers (prefetch depth)


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


def wanted_pool_bytes(r) -> int:
    """The pool that keeps every trainer rank fed: two optimizer windows plus every rank's loader prefetch
    resident under the producer's watermark, plus its overshoot."""
    resident = 2 * optimizer_window(r) + LOADER_PREFETCH_BATCHES * r.trainer.batch_size * r.gpus.per_node
    return int((resident + PRODUCER_OVERSHOOT_SAMPLES) * sample_bytes(r) / WATERMARK_FRACTION) + 1


def server_rows_bytes(r) -> int:
    """Captured rows the scheduler keeps on the writer's GPU until the sink has copied them (cuda_ipc)."""
    captured = (len(r.target.aux_layer_ids) + 1) * r.target.hidden_size * 2
    return (
        SERVER_PENDING_BATCHES * max(SGLANG_MAX_PREFILL_TOKENS, r.trainer.max_length + SERVER_CONTEXT_MARGIN) * captured
    )


def prefetch_bytes(r) -> int:
    """A trainer rank's prefetched samples (on its GPU with cuda_ipc; Mooncake keeps them on the host)."""
    return LOADER_PREFETCH_BATCHES * r.trainer.batch_size * sample_bytes(r)


def pool_room_bytes(r) -> int:
    """What GPU 0 has left for the pool: the trainer's room beside the server's static pool, less the captured
    rows and the trainer's planned peak (``trainer_terms`` + prefetch + ``trainer.reserve_gib``)."""
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


def sizing(r) -> FeatureSizing:
    """Everything above, for the strategies."""
    return FeatureSizing(
        sample_bytes=sample_bytes(r),
        window_samples=optimizer_window(r),
        overshoot_samples=PRODUCER_OVERSHOOT_SAMPLES,
        min_store_bytes=min_store_bytes(r),
        pool_bytes=pool_bytes(r),
        server_rows_bytes=server_rows_bytes(r),
        prefetch_bytes=prefetch_bytes(r),
        segment_bytes=segment_bytes(r),
    )


def strategy(r) -> Transport:
    """The strategy of a recipe whose ``server.transport`` names one (not ``auto``: the plan resolves that)."""
    return registry.get(r.server.transport)


def store_bytes(r) -> int:
    """Bytes the recipe's transport holds features in flight in: the pool (cuda_ipc) or the segment (mooncake)."""
    return strategy(r).store_bytes(sizing(r))


def watermarks(r) -> tuple[int, int]:
    """SpecForge's ``runtime.resident_{high,low}_watermark_bytes`` for the producer, from :func:`store_bytes`."""
    high = int(WATERMARK_FRACTION * store_bytes(r)) - PRODUCER_OVERSHOOT_SAMPLES * sample_bytes(r)
    return high, int(0.75 * high)


def memory_terms(r) -> dict[str, int]:
    """GPU bytes the recipe's transport adds (``Transport.memory_terms``)."""
    return strategy(r).memory_terms(sizing(r))


def runtime_config(r) -> dict[str, Any]:
    """The SpecForge ``runtime:`` section the transport needs: the producer's byte watermarks, so it pauses
    before the pool or the segment fills (refs alone do not bound bytes)."""
    high, low = watermarks(r)
    return {"resident_high_watermark_bytes": high, "resident_low_watermark_bytes": low}


def remove_stale_pools(r) -> list[str]:
    """What dead processes of the recipe's run left of its transport (a killed capture server's pool files),
    removed."""
    return strategy(r).remove_stale(r.output_dir)
