"""The memory split of a recipe whose transport is chosen: per GPU, the capture server's static pool against its
weights and KV cache, the trainer's planned peak against what is left, and what the transport adds.

Estimates are stated formulas (``trainer_terms``, ``transport_plan``), checked against measured peaks by
``bench/trainer_memory.py``.
"""

from __future__ import annotations

from specforge_kimi.plan import transport_plan
from specforge_kimi.plan.trainer_terms import draft_params, trainer_peak_bytes, trainer_room_bytes, trainer_terms
from specforge_kimi.transport.strategy import GIB, FeatureSizing, Transport


def memory_plan(r, strategy: Transport | None = None, sizing: FeatureSizing | None = None) -> dict:
    """Per-GPU memory estimate (GiB) for server and trainer, and whether they fit.

    server = mem_fraction_static x GPU memory, must hold weights/TP + kv_tokens x KV bytes;
    trainer = the sum of :func:`trainer_terms` + ``trainer.reserve_gib`` + what the transport puts on each rank's
    GPU; on the capture writer's GPU the transport's pool and captured rows come out of the trainer's room
    (``Transport.memory_terms``). ``strategy`` defaults to the one ``r.server.transport`` names.
    """
    strategy = strategy or transport_plan.strategy(r)
    sizing = sizing or transport_plan.sizing(r)
    g, t, s = r.gpus, r.target, r.server
    weights = t.weights_gib / (g.per_node * g.nnodes)
    kv = s.kv_tokens * t.kv_bytes_per_token / GIB
    server_pool = s.mem_fraction_static * g.memory_gib
    extra = strategy.memory_terms(sizing)
    trainer = trainer_peak_bytes(r, prefetch=extra["prefetch"]) / GIB
    terms = trainer_terms(r)
    trainer_room = trainer_room_bytes(r) / GIB
    writer_room = trainer_room - (extra["pool"] + extra["server_rows"]) / GIB
    why = []
    if weights + kv > server_pool:
        why.append(
            f"server needs {weights:.1f} GiB weights + {kv:.1f} GiB KV > {server_pool:.1f} GiB "
            f"(mem_fraction_static {s.mem_fraction_static} x {g.memory_gib} GiB)"
        )
    if trainer > trainer_room:
        why.append(f"trainer peak ~{trainer:.1f} GiB > {trainer_room:.1f} GiB left beside the server")
    elif trainer > writer_room:
        why.append(
            f"trainer peak ~{trainer:.1f} GiB > {writer_room:.1f} GiB left on GPU 0 beside the server, its "
            f"{strategy.name} pool ({extra['pool'] / GIB:.1f} GiB) and captured rows ({extra['server_rows'] / GIB:.1f} GiB)"
        )
    return {
        "transport": strategy.name,
        **strategy.memory_report(sizing, writer_room),
        "server_weights_gib": round(weights, 2),
        "server_kv_gib": round(kv, 2),
        "server_pool_gib": round(server_pool, 2),
        "draft_params": draft_params(r.trainer.draft),
        "trainer_peak_gib": round(trainer, 2),
        "trainer_sdpa_attention_gib": round(terms["sdpa_attention"] / GIB, 2),
        **({"trainer_objective_logits_gib": round(terms["objective_logits"] / GIB, 2)} if r.is_block else {}),
        "trainer_room_gib": round(trainer_room, 2),
        "fits": not why,
        "why": "; ".join(why),
    }
