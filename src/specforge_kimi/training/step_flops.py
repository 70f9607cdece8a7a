"""FLOPs of one SpecForge EAGLE-3 training step (forward + backward), per sample and per trained token.

Scope: SpecForge's online/offline eagle3 step as the consumer runs it at the pin
(``Eagle3TrainStrategy.forward_loss`` -> ``TargetHead`` -> ``OnlineEagle3Model.forward``, then
``loss.backward()``), for the Llama draft (``LlamaForCausalLMEagle3``) and our MLA draft
(``drafts/mla_eagle3.py``), batch 1, a sample of ``L`` tokens, TTT length ``T``. Plain arithmetic:
no torch. Counted are the matrix products (2 FLOPs per multiply-add); norms, RoPE, SiLU, softmaxes,
the KL loss, the teacher's softmax/logsumexp over the vocabulary, argmaxes and the optimizer are
elementwise and counted as zero (they show up as time in a profile, not here).

What the step computes (read from the pinned code)::

    target head (teacher)  once per step, FULL target vocab V (no compact teacher online):
                           logits = TargetHead.fc(target)  [L, Ht] x [Ht, V]      fwd 2 L Ht V, no bwd
                           (frozen weight, captured input: no autograd graph)
    fc                     once per step: project_hidden_states  [L, A Ht] x [A Ht, H]
                           fwd 2 L A Ht H, bwd 2 L A Ht H (weight grad only: the captured input
                           needs no grad)
    embedding              a gather from the frozen target copy: 0
    per TTT step k = 0..T-1 (the decoder layer and the draft head run T times over all L rows;
    SpecForge shifts ids/masks by padding, the length stays L):
      attention projections  Llama: q,k,v take cat(norm(emb), norm(h)) = 2H wide
                               fwd 2 L 2H (nh d + 2 nkv d) + 2 L nh d H (o_proj)
                             MLA: q_a 2H->q_lora, q_b q_lora->nh(nope+rope), kv_a 2H->kv_lora+rope,
                               kv_b kv_lora->nh(nope+v), o nh v->H
                             bwd 2x fwd (input and weight grads)
      attention core         scores 2 nh d_qk P_k + values 2 nh d_v P_k, bwd 2x fwd,
                             P_k = query/key pairs at step k (below)
      MLP                    fwd 3 x 2 L H I, bwd 2x
      draft head             fwd 2 L H Vd (lm_head over the draft vocab), bwd 2x
    total = target_head + fc + T x (attention projections + MLP + draft head) + sum_k core(P_k)

Pairs ``P_k`` by ``attention`` mode:

* ``"useful"`` (model FLOPs, the MFU convention): the pairs the EAGLE-3 mask keeps. Step ``k``'s
  keys are step 0's keys causally plus, for each earlier step ``j = 1..k``, the query's own
  position; flex shrinks the sample by ``k`` (``seq_lengths -= lck``): ``P_k = (L-k)(L-k+1)/2 +
  k (L-k)``.
* ``"sdpa"`` (what SpecForge's sdpa path -- and the MLA draft -- executes as matmuls, what
  ``torch.utils.flop_counter.FlopCounterMode`` counts): a dense ``L x L`` product with step 0's
  keys (masked after the product) per step, ``P_k = L^2``; the diagonal entries of later steps are
  elementwise ``(q * k_i).sum(-1)`` and not counted.
* ``"flex"`` (what flex_attention executes): whole ``B x B`` tiles (``block``, 128) of the
  block mask: causal tiles ``nb (nb + 1) / 2`` of the ``nb = ceil((L-k)/B)`` blocks plus ``k nb``
  diagonal tiles for the earlier steps' keys, ``P_k = B^2 (nb (nb+1)/2 + k nb)``; its backward
  recomputes the scores, so the core's backward is 2.5x forward in this mode.
* ``"fa"`` (what SpecForge's ``fa`` path executes as kernels, on flash_attn or our fa-kernel seam): one causal
  kernel over step 0's keys for the whole sample (rows past the shrunk length are computed, then zeroed),
  ``P_k = L (L+1) / 2``; the later steps' own-position keys are elementwise and not counted; the kernel's backward
  recomputes the scores (2.5x forward).

``flops_per_token = total / L`` (every position of the sample is trained at each TTT step). At the
B200 recipe's draft (H 7168, 56/8 heads of 128, I 18432, Vd 32000, V 163840, T 7) and L = 4096 the
model counts 3.82e10 FLOPs per token ``useful`` (MLP 1.66e10, draft head 9.6e9, attention projections
7.7e9, teacher head 2 Ht V = 2.35e9, attention core 1.2e9, fc 6.2e8); at 16k 4.19e10 (core 4.9e9).
``tests/unit/test_step_flops.py`` checks hand counts and that FlopCounterMode over SpecForge's own
step (Llama draft, sdpa path) and over the MLA draft counts exactly the ``"sdpa"`` total.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

ATTENTION_MODES = ("useful", "sdpa", "flex", "fa")
#: Terms, in the order a profile's classes are compared with them.
TERMS = ("fc", "attn_proj", "attn_core", "mlp", "draft_head", "target_head", "loss_softmax", "embedding")


@dataclass(frozen=True)
class DraftShape:
    """The sizes of a one-layer EAGLE-3 draft that set its matmuls."""

    kind: str  # "llama" or "mla"
    hidden: int
    target_hidden: int
    num_aux: int
    heads: int
    intermediate: int
    draft_vocab: int
    kv_heads: int = 0  # llama
    head_dim: int = 0  # llama
    q_lora: int = 0  # mla
    kv_lora: int = 0
    qk_nope: int = 0
    qk_rope: int = 0
    v_head: int = 0

    @property
    def qk_dim(self) -> int:
        return self.head_dim if self.kind == "llama" else self.qk_nope + self.qk_rope

    @property
    def v_dim(self) -> int:
        return self.head_dim if self.kind == "llama" else self.v_head


class _ConfigView:
    """A draft ``config.json`` read as a dict, seen through the typed draft's field names (an absent key: None)."""

    def __init__(self, config: Mapping) -> None:
        self._config = config

    def __getattr__(self, key: str):
        value = self._config.get(key)
        return _ConfigView(value) if isinstance(value, Mapping) else value


def draft_shape(draft, *, target_hidden: int | None = None) -> DraftShape:
    """The sizes of an EAGLE-3 draft config: a recipe's ``trainer.draft`` (``plan.draft_config.Eagle3Draft``, read
    by its typed fields), or a rendered ``config.json`` read as a dict (the same field names).

    MLA when the config has the MLA sizes (our ``Eagle3DeepseekV2ForCausalLM``), else Llama.
    """
    d = _ConfigView(draft) if isinstance(draft, Mapping) else draft
    h, heads = d.hidden_size, d.num_attention_heads
    common = {
        "hidden": h,
        "target_hidden": int(target_hidden or d.target_hidden_size or h),
        "heads": heads,
        "intermediate": d.intermediate_size,
        "draft_vocab": d.draft_vocab_size or d.vocab_size,
    }
    if d.kv_lora_rank is not None:
        ids = d.eagle_config.eagle_aux_hidden_state_layer_ids if d.eagle_config is not None else None
        return DraftShape(
            kind="mla",
            num_aux=3 if ids is None else len(ids),
            q_lora=d.q_lora_rank,
            kv_lora=d.kv_lora_rank,
            qk_nope=d.qk_nope_head_dim,
            qk_rope=d.qk_rope_head_dim,
            v_head=d.v_head_dim,
            **common,
        )
    # LlamaForCausalLMEagle3: fc is always 3 x target_hidden wide; head_dim defaults to H / heads
    return DraftShape(
        kind="llama",
        num_aux=3,
        kv_heads=d.num_key_value_heads or heads,
        head_dim=d.head_dim or h // heads,
        **common,
    )


def attention_pairs(length: int, step: int, mode: str = "useful", block: int = 128) -> int:
    """Query/key pairs whose products attention computes at TTT step ``step`` (0-based)."""
    n, k = length, step
    if mode == "useful":
        m = max(n - k, 0)
        return m * (m + 1) // 2 + k * m
    if mode == "sdpa":
        return n * n
    if mode == "fa":
        return n * (n + 1) // 2
    if mode == "flex":
        nb = math.ceil(max(n - k, 0) / block)
        return block * block * (nb * (nb + 1) // 2 + k * nb)
    raise ValueError(f"attention mode {mode!r} is not one of {ATTENTION_MODES}")


@dataclass(frozen=True)
class StepFlops:
    """One step's FLOPs by term: ``forward[term]``, ``backward[term]``; totals per sample and token."""

    length: int
    ttt_length: int
    attention: str
    forward: dict = field(default_factory=dict)
    backward: dict = field(default_factory=dict)

    @property
    def by_term(self) -> dict:
        return {t: self.forward[t] + self.backward[t] for t in TERMS}

    @property
    def total(self) -> int:
        return sum(self.by_term.values())

    @property
    def per_token(self) -> float:
        return self.total / self.length


def step_flops(
    draft,
    *,
    length: int,
    ttt_length: int,
    target_vocab: int,
    target_hidden: int | None = None,
    attention: str = "useful",
    block: int = 128,
) -> StepFlops:
    """FLOPs of one EAGLE-3 training step on one sample of ``length`` tokens (formula: module docstring)."""
    s = draft if isinstance(draft, DraftShape) else draft_shape(draft, target_hidden=target_hidden)
    if attention not in ATTENTION_MODES:
        raise ValueError(f"attention mode {attention!r} is not one of {ATTENTION_MODES}")
    n, t, h = length, ttt_length, s.hidden
    if s.kind == "llama":
        proj_width = 2 * h * (s.heads * s.head_dim + 2 * s.kv_heads * s.head_dim) + s.heads * s.head_dim * h
    else:
        proj_width = (
            2 * h * s.q_lora
            + s.q_lora * s.heads * (s.qk_nope + s.qk_rope)
            + 2 * h * (s.kv_lora + s.qk_rope)
            + s.kv_lora * s.heads * (s.qk_nope + s.v_head)
            + s.heads * s.v_head * h
        )
    pairs = sum(attention_pairs(n, k, attention, block) for k in range(t))
    fwd = {
        "fc": 2 * n * s.num_aux * s.target_hidden * h,
        "attn_proj": t * 2 * n * proj_width,
        "attn_core": 2 * s.heads * (s.qk_dim + s.v_dim) * pairs,
        "mlp": t * 3 * 2 * n * h * s.intermediate,
        "draft_head": t * 2 * n * h * s.draft_vocab,
        "target_head": 2 * n * s.target_hidden * target_vocab,
        "loss_softmax": 0,
        "embedding": 0,
    }
    core_bwd = fwd["attn_core"] * 5 // 2 if attention in ("flex", "fa") else 2 * fwd["attn_core"]
    bwd = {
        "fc": fwd["fc"],  # weight grad only: the captured features need no grad
        "attn_proj": 2 * fwd["attn_proj"],
        "attn_core": core_bwd,
        "mlp": 2 * fwd["mlp"],
        "draft_head": 2 * fwd["draft_head"],
        "target_head": 0,  # frozen, its input needs no grad: no graph
        "loss_softmax": 0,
        "embedding": 0,
    }
    return StepFlops(length=n, ttt_length=t, attention=attention, forward=fwd, backward=bwd)


def recipe_step_flops(recipe, *, length: int, attention: str = "useful") -> StepFlops:
    """``step_flops`` for a loaded recipe's draft, target and TTT length."""
    return step_flops(
        recipe.trainer.draft,
        length=length,
        ttt_length=recipe.trainer.ttt_length,
        target_vocab=recipe.target.vocab_size,
        target_hidden=recipe.target.hidden_size,
        attention=attention,
    )


#: :func:`train_flops_per_token`'s terms, ``total`` their sum
TRAIN_TERMS = ("fc", "layers", "draft_head", "target_head")


def train_flops_per_token(recipe, *, length: int | None = None) -> dict:
    """Training GEMM + attention FLOPs per trained token of a recipe's draft step, term by term (:data:`TRAIN_TERMS`
    and ``total``), one convention for both families so that their ratio is fair (``bench/sizing.py`` scales a block
    draft's trainer rate from its EAGLE-3 twin's by it; ``bench/trainer_memory.py`` reads a block step's FLOP/s
    against it): 2 FLOPs per multiply-add; a trained weight costs 3x its forward, a frozen one with its input's
    gradient 2x, a frozen one without 1x; causal attention over S/2 keys on average, ``S`` = ``length`` (default
    ``trainer.max_length``); widths are the target's.

    EAGLE-3: the fc over the captured layers, then ``ttt_length`` x (the layer on [emb, hidden] + the draft head),
    the target head's forward once (:func:`step_flops` counts the same step exactly, per attention mode). A block
    draft (DFlash, DSpark: ``trainer.block``): the fc over its captured layers and each layer's k/v for the S context
    rows, each of the ``num_hidden_layers`` layers on anchors x block queries per sample (per token: anchors x block /
    S, anchors capped at S), the frozen head on every query with its input's gradient; DSpark's Markov and confidence
    heads are not counted."""
    t, tr, d = recipe.target, recipe.trainer, recipe.trainer.draft
    h, s_len = t.hidden_size, tr.max_length if length is None else length
    a = d.num_attention_heads
    k = d.num_key_value_heads or a
    hd, inter = d.head_dim or h // a, d.intermediate_size
    attn = 4 * (s_len / 2) * a * hd  # scores + values, one query
    fc = 6 * len(recipe.capture_ids) * h * h
    if tr.family == "eagle3":
        layer = 2 * h * a * hd + 2 * 2 * h * k * hd + a * hd * h + 3 * h * inter
        per_step = 6 * layer + 3 * attn + 6 * d.draft_vocab_size * h
        return {
            "fc": fc,
            "layers": tr.ttt_length * (6 * layer + 3 * attn),
            "draft_head": tr.ttt_length * 6 * d.draft_vocab_size * h,
            "target_head": 2 * t.vocab_size * h,
            "total": fc + tr.ttt_length * per_step + 2 * t.vocab_size * h,
        }
    b = tr.block
    q = min(b.num_anchors, s_len) * b.block_size / s_len  # queries per trained token
    n = d.num_hidden_layers
    query = 2 * h * a * hd + 2 * h * k * hd + 3 * h * inter  # q, o, k/v of the noise, the MLP
    context = 2 * h * k * hd  # k/v of each context row
    layers = n * (q * (6 * query + 3 * attn) + 6 * context)
    head = q * 4 * t.vocab_size * h
    return {"fc": fc, "layers": layers, "draft_head": 0.0, "target_head": head, "total": fc + layers + head}
