"""The trainer side of a recipe's memory plan, term by term (``recipes.memory_plan`` sums them; the cuda_ipc pool's
size, ``transport_plan.pool_room_bytes``, is what GPU 0 has left beside them).

Scope: arithmetic on a validated recipe (``plan.recipes.Recipe``) and its draft config; no imports of torch or
SpecForge. ``bench/trainer_memory.py`` measures the same terms on a GPU with SpecForge's own step.
"""

from __future__ import annotations


def draft_params(d: dict) -> int:
    """Trainable parameters of a draft config (Llama EAGLE-3, or the MLA ``Eagle3DeepseekV2ForCausalLM``)."""
    h, inter = d["hidden_size"], d["intermediate_size"]
    if "kv_lora_rank" in d:  # MLA (Eagle3DeepseekV2ForCausalLM): the down-projections take [emb, hidden] (2h)
        heads, q, kv = d["num_attention_heads"], d["q_lora_rank"], d["kv_lora_rank"]
        nope, rope, v = d["qk_nope_head_dim"], d["qk_rope_head_dim"], d["v_head_dim"]
        attn = 2 * h * q + q * heads * (nope + rope) + 2 * h * (kv + rope) + kv * heads * (nope + v) + heads * v * h
        return 3 * h * h + attn + 3 * h * inter + d["draft_vocab_size"] * h + 4 * h + q + kv
    heads, kv = d["num_attention_heads"], d.get("num_key_value_heads", d["num_attention_heads"])
    hd = d.get("head_dim", h // heads)
    attn = 2 * h * heads * hd + 2 * 2 * h * kv * hd + heads * hd * h  # q,k,v take [emb, hidden] (2h)
    mlp = 3 * h * inter
    return 3 * h * h + attn + mlp + d["draft_vocab_size"] * h + 3 * h


def trainer_terms(r, *, max_length: int | None = None, attention_backend: str | None = None) -> dict:
    """The trainer side of :func:`memory_plan`, term by term, in bytes (reserve excluded); ``max_length`` and
    ``attention_backend`` override the recipe's (what a sample of that length costs on that backend).

    ``optimizer``: draft params x 16 B (bf16 weights + fp32 master + Adam m, v + bf16 grads);
    ``frozen_tables``: the draft's frozen embedding and SpecForge's ``TargetHead``, bf16
    (vocab x hidden x 2 B each); ``activations``: max_length x ttt_length x (draft_vocab x 12 B +
    hidden x 64 B); ``sdpa_attention``: with ``attention_backend: sdpa``, 6 B x draft heads x
    ttt_length x max_length^2 (SpecForge's eager TTT attention keeps each step's fp32 softmax and
    its bf16 copy for the backward), else 0; ``teacher_logits``: max_length x target vocab x 10 B
    (online, SpecForge's TargetHead makes the full bf16 logits, then ``_compute_target_p`` takes
    them to fp32 and a logsumexp; its chunked compact teacher is offline-only;
    ``bench/studies/teacher_memory_cpu.py`` measures 8.1 B on the CPU, the 10 leaves room for the CUDA
    allocator). ``bench/trainer_memory.py`` measures the sum on a GPU with SpecForge's own step.
    """
    t, tr = r.target, r.trainer
    d = tr.draft
    length = tr.max_length if max_length is None else max_length
    backend = tr.attention_backend if attention_backend is None else attention_backend
    return {
        "optimizer": draft_params(d) * 16,
        "frozen_tables": 2 * t.vocab_size * t.hidden_size * 2,
        "activations": length * tr.ttt_length * (d["draft_vocab_size"] * 12 + t.hidden_size * 64),
        "sdpa_attention": 6 * d["num_attention_heads"] * tr.ttt_length * length**2 if backend == "sdpa" else 0,
        "teacher_logits": length * t.vocab_size * 10,
    }


def trainer_peak_bytes(r, *, prefetch: int = 0) -> int:
    """A trainer rank's planned peak: :func:`trainer_terms` + ``prefetch`` (cuda_ipc's samples on the rank's GPU)
    + ``trainer.reserve_gib``."""
    return int(sum(trainer_terms(r).values()) + prefetch + r.trainer.reserve_gib * (1 << 30))


def trainer_room_bytes(r) -> int:
    """What a GPU leaves the trainer beside the capture server's static pool."""
    return int((1 - r.server.mem_fraction_static) * r.gpus.memory_gib * (1 << 30))
