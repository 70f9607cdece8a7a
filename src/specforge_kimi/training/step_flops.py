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

ATTENTION_MODES = ("useful", "sdpa", "flex")
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


def draft_shape(draft: Mapping, *, target_hidden: int | None = None) -> DraftShape:
    """Read a draft config dict (a recipe's ``trainer.draft`` or a rendered ``config.json``).

    MLA when the config has ``q_lora_rank`` (our ``Eagle3DeepseekV2ForCausalLM``), else Llama.
    """
    h = int(draft["hidden_size"])
    heads = int(draft["num_attention_heads"])
    common = {
        "hidden": h,
        "target_hidden": int(target_hidden or draft.get("target_hidden_size") or h),
        "heads": heads,
        "intermediate": int(draft["intermediate_size"]),
        "draft_vocab": int(draft.get("draft_vocab_size") or draft["vocab_size"]),
    }
    if draft.get("q_lora_rank"):
        eagle = draft.get("eagle_config") or {}
        ids = eagle.get("eagle_aux_hidden_state_layer_ids") or draft.get("eagle_aux_hidden_state_layer_ids")
        return DraftShape(
            kind="mla",
            num_aux=3 if ids is None else len(ids),
            q_lora=int(draft["q_lora_rank"]),
            kv_lora=int(draft["kv_lora_rank"]),
            qk_nope=int(draft["qk_nope_head_dim"]),
            qk_rope=int(draft["qk_rope_head_dim"]),
            v_head=int(draft["v_head_dim"]),
            **common,
        )
    # LlamaForCausalLMEagle3: fc is always 3 x target_hidden wide; head_dim defaults to H / heads
    return DraftShape(
        kind="llama",
        num_aux=3,
        kv_heads=int(draft.get("num_key_value_heads") or heads),
        head_dim=int(draft.get("head_dim") or h // heads),
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
    draft: Mapping | DraftShape,
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
    core_bwd = fwd["attn_core"] * 5 // 2 if attention == "flex" else 2 * fwd["attn_core"]
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
