"""A recipe's features in flight, sized: the bytes of a sample, the optimizer window, the cuda_ipc pool's size, the
producer's byte watermarks, what the transports' strategies read (:class:`~specforge_kimi.transport.strategy.
FeatureSizing`).

Scope: arithmetic on a recipe's sections. What each transport refuses and adds lives in its strategy
(:mod:`specforge_kimi.transport.cuda_ipc`, :mod:`specforge_kimi.transport.mooncake`); the plan asks them
(``plan.run_plan.choose_transport``).

Sizing. A sample of ``max_length`` tokens takes ``S = max_length x feature bytes per token`` in the pool
(:func:`feature_layout`, by draft family: EAGLE-3 (aux layers + 1) x hidden x 2 B + 3 int64 passthrough; DFlash
N target layers x hidden x 2 B + 2 int64 passthrough; DSpark N + 1 layers, the last hidden included). The consumer needs one whole optimizer window of
``Q = trainer ranks x batch x accumulation`` samples before it acknowledges (and releases) anything, and
SpecForge's producer overshoots its watermark by up to ``producer_concurrency x producer_lease`` samples
(defaults 1 x 8). So the pool must hold ``Q x S + 8 S``; the recipe's producer is given a resident-byte high
watermark of ``0.8 x pool - 8 S`` (low: 3/4 of it), so it pauses before the server's pool fills, and the
server's wait for space (backpressure) is a backstop. That minimum keeps the trainer fed only in bursts: every
rank's loader also holds its prefetched samples' slots (4 batches ahead for EAGLE-3, 8 for a block draft), and a producer paused at one window
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

from dataclasses import dataclass
from typing import Any

from specforge_kimi.plan.inputs import SERVER_CONTEXT_MARGIN
from specforge_kimi.plan.trainer_terms import trainer_peak_bytes, trainer_room_bytes
from specforge_kimi.transport import registry
from specforge_kimi.transport.strategy import GIB, WATERMARK_FRACTION, FeatureSizing, Transport

PASSTHROUGH_BYTES_PER_TOKEN = 3 * 8  # EAGLE-3: input_ids, loss_mask, attention_mask (int64)
PRODUCER_OVERSHOOT_SAMPLES = 1 * 8  # SpecForge's runtime.producer_concurrency x producer_lease defaults
PRODUCER_LEASE = 8  # SpecForge's runtime.producer_lease default (prompts per capture call)
SERVER_PENDING_BATCHES = 2  # SGLANG_SPEC_CAPTURE_MAX_PENDING_BATCHES default
SGLANG_MAX_PREFILL_TOKENS = 16384  # SGLang 0.5.14's default --max-prefill-tokens
LOADER_PREFETCH_BATCHES = 4  # SpecForge's eagle3 default_dataloader_num_workers (prefetch depth)
BLOCK_LOADER_PREFETCH_BATCHES = 8  # SpecForge's dflash and dspark default_dataloader_num_workers


@dataclass(frozen=True)
class FeatureLayout:
    """What one captured token carries for a draft family (SpecForge's ``ServerCaptureLayout`` of its strategy)."""

    captured_layers: int  # target layers in the aux rows (EAGLE-3: its 3 aux ids; a block draft: its N ids)
    captures_last_hidden: bool  # the post-norm last hidden state too (EAGLE-3, DSpark; not DFlash)
    passthrough_count: int  # int64 passthrough tensors (EAGLE-3: input_ids, loss_mask, attention_mask; block: 2)
    prefetch_batches: int  # batches SpecForge's loader for the strategy keeps ahead

    def rows_bytes_per_token(self, hidden_size: int) -> int:
        """Captured rows per token, bf16: what the scheduler holds and the pool stores besides the passthrough."""
        return (self.captured_layers + int(self.captures_last_hidden)) * hidden_size * 2

    def bytes_per_token(self, hidden_size: int) -> int:
        return self.rows_bytes_per_token(hidden_size) + self.passthrough_count * 8


def feature_layout(r) -> FeatureLayout:
    """The recipe's :class:`FeatureLayout`, from ``trainer.family`` and its capture ids."""
    family = r.trainer.family
    if family == "eagle3":
        return FeatureLayout(len(r.capture_ids), True, PASSTHROUGH_BYTES_PER_TOKEN // 8, LOADER_PREFETCH_BATCHES)
    return FeatureLayout(len(r.capture_ids), family == "dspark", 2, BLOCK_LOADER_PREFETCH_BATCHES)


def feature_bytes_per_token(r) -> int:
    """Pool bytes per captured token: the family's captured layers x hidden x 2 B (bf16) + the passthrough."""
    return feature_layout(r).bytes_per_token(r.target.hidden_size)


def sample_bytes(r) -> int:
    return r.trainer.max_length * feature_bytes_per_token(r)


def optimizer_window(r) -> int:
    """Samples the consumer takes before it acknowledges: ranks x batch x accumulation (SpecForge's default 1)."""
    return r.gpus.per_node * r.gpus.nnodes * r.trainer.batch_size


def overshoot_samples(r) -> int:
    """Samples the producer may put past its watermark: ``overlap.producer_concurrency`` capture calls of
    :data:`PRODUCER_LEASE` prompts each (:data:`PRODUCER_OVERSHOOT_SAMPLES` at SpecForge's defaults)."""
    return r.overlap.producer_concurrency * PRODUCER_LEASE


def min_store_bytes(r) -> int:
    """The least a store of features in flight (the cuda_ipc pool, the Mooncake segment) may hold: one optimizer
    window plus the producer's overshoot, at the watermark fraction."""
    s = sample_bytes(r)
    return int((optimizer_window(r) * s + overshoot_samples(r) * s) / WATERMARK_FRACTION) + 1


def segment_bytes(r) -> int:
    """The Mooncake segment holding features in flight (the server's, or the keeper's: the same size)."""
    return int(r.mooncake.global_segment_gib * GIB)


def wanted_pool_bytes(r) -> int:
    """The pool that keeps every trainer rank fed: two optimizer windows plus every rank's loader prefetch
    resident under the producer's watermark, plus its overshoot."""
    resident = 2 * optimizer_window(r) + feature_layout(r).prefetch_batches * r.trainer.batch_size * r.gpus.per_node
    return int((resident + overshoot_samples(r)) * sample_bytes(r) / WATERMARK_FRACTION) + 1


def server_rows_bytes(r) -> int:
    """Captured rows the scheduler keeps on the writer's GPU until the sink has copied them (cuda_ipc)."""
    captured = feature_layout(r).rows_bytes_per_token(r.target.hidden_size)
    return (
        SERVER_PENDING_BATCHES * max(SGLANG_MAX_PREFILL_TOKENS, r.trainer.max_length + SERVER_CONTEXT_MARGIN) * captured
    )


def prefetch_bytes(r) -> int:
    """A trainer rank's prefetched samples (on its GPU with cuda_ipc; Mooncake keeps them on the host)."""
    return feature_layout(r).prefetch_batches * r.trainer.batch_size * sample_bytes(r)


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
        overshoot_samples=overshoot_samples(r),
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
    high = int(WATERMARK_FRACTION * store_bytes(r)) - overshoot_samples(r) * sample_bytes(r)
    return high, int(0.75 * high)


def memory_terms(r) -> dict[str, int]:
    """GPU bytes the recipe's transport adds (``Transport.memory_terms``)."""
    return strategy(r).memory_terms(sizing(r))


def runtime_config(r) -> dict[str, Any]:
    """The SpecForge ``runtime:`` section the transport needs: the producer's byte watermarks, so it pauses
    before the pool or the segment fills (refs alone do not bound bytes)."""
    high, low = watermarks(r)
    out = {"resident_high_watermark_bytes": high, "resident_low_watermark_bytes": low}
    if r.overlap.producer_concurrency != 1:  # overlap.producer_concurrency: calls in flight (SpecForge's default 1)
        out["producer_concurrency"] = r.overlap.producer_concurrency
    return out


def remove_stale_pools(r) -> list[str]:
    """What dead processes of the recipe's run left of its transport (a killed capture server's pool files),
    removed."""
    return strategy(r).remove_stale(r.output_dir)
