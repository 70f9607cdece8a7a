"""SpecForge's own EAGLE-3 step on the CPU, for tests: strategy -> ``TargetHead`` -> ``OnlineEagle3Model``.

Scope: a tiny draft (any ``Eagle3DraftModel``), a random frozen target head and one seeded capture-shaped
batch; the caller picks the ``OnlineEagle3Model`` class (SpecForge's, or one loaded from a patched copy by
``setup_patches.load_patched_specforge_module``). SpecForge's CPU path needs ``training.cpu_shims`` installed
(the ``cpu_shims`` fixture in conftest.py).
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
):
    """A zero-argument callable running one forward + backward and returning the loss (a detached tensor); the
    step's metrics (``StepOutput.metrics``) are left in its ``metrics`` attribute. The draft vocabulary is the first
    ``draft_vocab_size`` target ids, or the sorted target ids ``draft_ids``; ``lk_loss_type``: SpecForge's LK
    objective (None: KL only)."""
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
    batch = TrainBatch(
        sample_ids=["cpu-step"],
        strategy="eagle3",
        tensors={
            "input_ids": torch.randint(0, vocab, (1, length), generator=g),
            "attention_mask": torch.ones(1, length, dtype=torch.long),
            "loss_mask": torch.ones(1, length, dtype=torch.long),
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
