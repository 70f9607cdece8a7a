"""The trainer side of a recipe's memory plan, term by term (``recipes.memory_plan`` sums them; the cuda_ipc pool's
size, ``transport_plan.pool_room_bytes``, is what GPU 0 has left beside them).

Scope: arithmetic on a validated recipe (``plan.recipes.Recipe``) and its draft config; no imports of torch or
SpecForge. ``bench/trainer_memory.py`` measures the same terms on a GPU with SpecForge's own step.
"""

from __future__ import annotations

from specforge_kimi.plan.draft_config import DFlashDraft, DraftConfig, DSparkConfig


def draft_params(d: DraftConfig) -> int:
    """Trainable parameters of a draft config (Llama EAGLE-3, the MLA ``Eagle3DeepseekV2ForCausalLM``, or a block
    draft: :func:`block_draft_params`)."""
    if isinstance(d, DFlashDraft):
        return block_draft_params(d)
    h, inter = d.hidden_size, d.intermediate_size
    if d.is_mla:  # Eagle3DeepseekV2ForCausalLM: the down-projections take [emb, hidden] (2h)
        heads, q, kv = d.num_attention_heads, d.q_lora_rank, d.kv_lora_rank
        nope, rope, v = d.qk_nope_head_dim, d.qk_rope_head_dim, d.v_head_dim
        attn = 2 * h * q + q * heads * (nope + rope) + 2 * h * (kv + rope) + kv * heads * (nope + v) + heads * v * h
        return 3 * h * h + attn + 3 * h * inter + d.draft_vocab_size * h + 4 * h + q + kv
    heads = d.num_attention_heads
    kv = heads if d.num_key_value_heads is None else d.num_key_value_heads
    hd = h // heads if d.head_dim is None else d.head_dim
    attn = 2 * h * heads * hd + 2 * 2 * h * kv * hd + heads * hd * h  # q,k,v take [emb, hidden] (2h)
    mlp = 3 * h * inter
    return 3 * h * h + attn + mlp + d.draft_vocab_size * h + 3 * h


def block_draft_params(d: DFlashDraft) -> int:
    """Trainable parameters of SpecForge's ``DFlashDraftModel`` / ``DSparkDraftModel`` (Qwen3-style layers; no
    embedding or LM head: the target's, frozen). Per layer: q/k/v/o, the MLP, two RMSNorms and the q/k norms; then
    ``fc`` [h, N x h] over the N captured target layers, ``hidden_norm`` and ``norm``. DSpark adds its Markov head
    (2 x vocab x rank) and its confidence head (h, + rank with the Markov input, + 1)."""
    h, inter, n = d.hidden_size, d.intermediate_size, d.num_hidden_layers
    a, k, hd = d.num_attention_heads, d.num_key_value_heads, d.head_dim
    dc = d.dflash_config
    layer = h * a * hd + 2 * h * k * hd + a * hd * h + 3 * h * inter + 2 * h + 2 * hd
    params = n * layer + len(dc.target_layer_ids) * h * h + 2 * h
    if isinstance(dc, DSparkConfig) and dc.markov_rank is not None:
        rank = dc.markov_rank
        params += 2 * d.vocab_size * rank + h + (rank if dc.confidence_head_with_markov else 0) + 1
    return params


def block_trainer_terms(r, *, max_length: int | None = None) -> dict:
    """:func:`trainer_terms` of a block draft (``trainer.family`` dflash or dspark), in bytes, checked on a GPU by
    ``bench/trainer_memory.py --recipe <a dflash recipe>`` (its rows' ``measured_over_plan``) as EAGLE-3's terms are.

    With ``n`` draft layers, width ``h``, heads ``a``/``k`` of dim ``d``, MLP ``I``, vocab ``V``, anchors ``A``,
    block ``B``, length ``S`` (anchors at most ``S``): ``optimizer`` = params x 16 B; ``frozen_tables`` = the target's embedding and head,
    2 x V x h x 2 B; ``activations`` ~ n x [A x B x (6h + 2ad + 3I) x 2 B + S x 2kd x 2 B] + 2 x S x h x 2 B
    (each layer runs A x B noise queries and projects keys and values for S context rows); ``objective_logits`` =
    objective_chunk_blocks x B x V x 10 B (checkpointed chunks; all A blocks when 0), 16 B for DSpark (its teacher
    softmax). No TTT, so no ``teacher_logits`` or ``sdpa_attention`` (kept at 0 for the memory report)."""
    t, tr, d = r.target, r.trainer, r.trainer.draft
    b = tr.block
    length = tr.max_length if max_length is None else max_length
    h, a, k, hd, inter = (
        t.hidden_size,
        d.num_attention_heads,
        d.num_key_value_heads,
        d.head_dim,
        d.intermediate_size,
    )
    anchors = min(b.num_anchors, length)  # SpecForge caps anchors at the sample's valid positions
    queries = anchors * b.block_size
    per_layer = queries * (6 * h + 2 * a * hd + 3 * inter) * 2 + length * 2 * k * hd * 2
    chunk = min(b.objective_chunk_blocks or anchors, anchors)
    return {
        "optimizer": block_draft_params(d) * 16,
        "frozen_tables": 2 * t.vocab_size * h * 2,
        "activations": d.num_hidden_layers * per_layer + 2 * length * h * 2,
        "objective_logits": chunk * b.block_size * t.vocab_size * (16 if tr.family == "dspark" else 10),
        "sdpa_attention": 0,
        "teacher_logits": 0,
    }


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
    A block draft's terms are :func:`block_trainer_terms`.
    """
    if r.trainer.family != "eagle3":
        return block_trainer_terms(r, max_length=max_length)
    t, tr = r.target, r.trainer
    d = tr.draft
    length = tr.max_length if max_length is None else max_length
    backend = tr.attention_backend if attention_backend is None else attention_backend
    return {
        "optimizer": draft_params(d) * 16,
        "frozen_tables": 2 * t.vocab_size * t.hidden_size * 2,
        "activations": length * tr.ttt_length * (d.draft_vocab_size * 12 + t.hidden_size * 64),
        "sdpa_attention": 6 * d.num_attention_heads * tr.ttt_length * length**2 if backend == "sdpa" else 0,
        "teacher_logits": length * t.vocab_size * 10,
    }


def trainer_peak_bytes(r, *, prefetch: int = 0) -> int:
    """A trainer rank's planned peak: :func:`trainer_terms` + ``prefetch`` (cuda_ipc's samples on the rank's GPU)
    + ``trainer.reserve_gib``."""
    return int(sum(trainer_terms(r).values()) + prefetch + r.trainer.reserve_gib * (1 << 30))


def trainer_room_bytes(r) -> int:
    """What a GPU leaves the trainer beside the capture server's static pool."""
    return int((1 - r.server.mem_fraction_static) * r.gpus.memory_gib * (1 << 30))
