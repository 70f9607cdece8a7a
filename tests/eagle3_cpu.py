"""SpecForge's own EAGLE-3 step on the CPU, for tests: strategy -> ``TargetHead`` -> ``OnlineEagle3Model``.

Scope: a tiny draft (any ``Eagle3DraftModel``), a random frozen target head and one seeded capture-shaped
batch; the caller picks the ``OnlineEagle3Model`` class (SpecForge's, or one loaded from a patched copy by
``setup_patches.load_patched_specforge_module``). SpecForge's CPU path needs ``training.cpu_shims`` installed
(the ``cpu_shims`` fixture in conftest.py). Also the tiny draft configs the step tests share (:data:`LLAMA_H64`,
:data:`MLA_H16`, :func:`mla_draft`) and the EAGLE-3 TTT attention written out densely (:func:`dense_eagle3_attention`,
the fa-kernel seam's reference on the CPU and the GPU).
"""

from __future__ import annotations


def eagle3_step(
    draft_model,
    *,
    length: int,
    ttt: int,
    vocab: int,
    target_hidden: int,
    model_cls=None,
    attention="sdpa",
    draft_ids=None,
    lk_loss_type=None,
    valid_length=None,
):
    """A zero-argument callable running one forward + backward and returning the loss (a detached tensor); the
    step's metrics (``StepOutput.metrics``) are left in its ``metrics`` attribute. The draft vocabulary is the first
    ``draft_vocab_size`` target ids, or the sorted target ids ``draft_ids``; ``lk_loss_type``: SpecForge's LK
    objective (None: KL only); ``valid_length``: the sample's real tokens, the rest right padding (attention and loss
    masks 0; None: all ``length``)."""
    import torch
    import torch.nn as nn
    from specforge.modeling.target.target_head import TargetHead
    from specforge.runtime.contracts import TrainBatch
    from specforge.training.strategies.base import Eagle3TrainStrategy

    if model_cls is None:
        from specforge.algorithms.eagle3.model import OnlineEagle3Model as model_cls
    vd = draft_model.draft_vocab_size
    draft_model.t2d.zero_()
    if draft_ids is None:
        draft_model.t2d[:vd] = True  # draft ids are the first vd target ids: d2t stays 0
    else:
        ids = torch.as_tensor(draft_ids)
        draft_model.t2d[ids] = True
        draft_model.d2t.copy_(ids - torch.arange(vd))  # SpecForge's d2t: target id minus draft id
    draft_model.embed_tokens.weight.requires_grad_(False)  # SpecForge freezes the target-copied embedding
    head = TargetHead.__new__(TargetHead)  # the real class, its weight set here instead of read from disk
    nn.Module.__init__(head)
    head.fc = nn.Linear(target_hidden, vocab, bias=False).requires_grad_(False)
    model = model_cls(draft_model, length=ttt, attention_backend=attention, lk_loss_type=lk_loss_type)
    strategy = Eagle3TrainStrategy(model, target_head=head)
    g = torch.Generator().manual_seed(0)
    real = (torch.arange(length) < (length if valid_length is None else valid_length)).long().unsqueeze(0)
    batch = TrainBatch(
        sample_ids=["cpu-step"],
        strategy="eagle3",
        tensors={
            "input_ids": torch.randint(0, vocab, (1, length), generator=g),
            "attention_mask": real.clone(),
            "loss_mask": real.clone(),
            "hidden_state": torch.randn(1, length, 3 * target_hidden, generator=g),
            "target": torch.randn(1, length, target_hidden, generator=g),
        },
        metadata={"target_repr": "hidden_state"},
    )

    def run():
        out = strategy.forward_loss(batch)
        out.loss.backward()
        run.metrics = out.metrics
        return out.loss.detach()

    return run


#: a tiny Llama EAGLE-3 draft config (hidden 64, 4 / 2 heads of 16, MLP 160, draft vocab 32 of 96; target hidden 64)
LLAMA_H64 = {
    "architectures": ["LlamaForCausalLMEagle3"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_hidden_layers": 1,
    "vocab_size": 96,
    "draft_vocab_size": 32,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 128,
    "rope_theta": 10000.0,
    "pad_token_id": 0,
    "hidden_act": "silu",
}
#: a tiny MLA draft config (hidden 16, 2 heads, q / kv lora 6 / 4, draft vocab 12 of 40; target hidden 16)
MLA_H16 = {
    "hidden_size": 16,
    "intermediate_size": 24,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "q_lora_rank": 6,
    "kv_lora_rank": 4,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 4,
    "v_head_dim": 6,
    "vocab_size": 40,
    "draft_vocab_size": 12,
}


def mla_draft():
    """Our MLA EAGLE-3 draft (``drafts.mla_eagle3``) at :data:`MLA_H16`, target hidden 16, sdpa attention."""
    from specforge_kimi.drafts.mla_eagle3 import Eagle3DeepseekV2ForCausalLM, KimiMLAEagle3Config

    cfg = KimiMLAEagle3Config(
        **MLA_H16,
        num_hidden_layers=1,
        rms_norm_eps=1e-5,
        max_position_embeddings=64,
        rope_theta=10000.0,
        rope_scaling=None,
        pad_token_id=0,
        hidden_act="silu",
        target_hidden_size=16,
    )
    return Eagle3DeepseekV2ForCausalLM(cfg, attention_backend="sdpa")


def llama_step():
    """One eagle3 step of SpecForge's Llama draft at :data:`LLAMA_H64` (seed 0, sdpa, 24 tokens, TTT length 3,
    target hidden 64): (draft, loss, {name: gradient})."""
    import torch
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
    from transformers import LlamaConfig

    torch.manual_seed(0)
    draft = LlamaForCausalLMEagle3(LlamaConfig(**LLAMA_H64), attention_backend="sdpa")
    loss = eagle3_step(draft, length=24, ttt=3, vocab=LLAMA_H64["vocab_size"], target_hidden=64)()
    return draft, loss, {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}


def mla_step():
    """One eagle3 step of :func:`mla_draft` (seed 0, 10 tokens, TTT length 3): (draft, loss, {name: gradient})."""
    import torch

    torch.manual_seed(0)
    draft = mla_draft()
    loss = eagle3_step(draft, length=10, ttt=3, vocab=MLA_H16["vocab_size"], target_hidden=16)()
    return draft, loss, {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}


def dense_eagle3_attention(q, cache_k, cache_v, valid, scale, dtype):
    """The EAGLE-3 TTT attention computed densely in ``dtype``: query [B, S, H, D] over the keys and values of every
    block [B, blocks, S, H_kv, D] with the mask written out -- causal over block 0, the query's own position in each
    later block, rows at or past ``valid`` [B] zero -- output [B, S, H, D]."""
    import torch

    b, s, h, d = q.shape
    n, h_kv = cache_k.shape[1], cache_k.shape[3]
    k, v = (t.to(dtype).permute(0, 3, 1, 2, 4).reshape(b, h_kv, n * s, d).repeat_interleave(h // h_kv, dim=1)
            for t in (cache_k, cache_v))  # fmt: skip
    scores = torch.einsum("bshd,bhkd->bhsk", q.to(dtype), k) * scale
    qi = torch.arange(s, device=q.device).view(s, 1)
    kv = torch.arange(n * s, device=q.device).view(1, n * s)
    keep = ((kv < s) & (kv <= qi)) | ((kv >= s) & (kv % s == qi))
    rows = torch.arange(s, device=q.device).view(1, s, 1) < valid.view(b, 1, 1)
    keep = (keep.unsqueeze(0) & rows).unsqueeze(1)  # [B, 1, S, blocks x S]
    p = torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1).nan_to_num(0.0)
    return torch.einsum("bhsk,bhkd->bshd", p, v)
