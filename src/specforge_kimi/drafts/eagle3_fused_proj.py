"""The ``eagle3-fused-proj`` seam: the EAGLE-3 Llama draft layer's sibling projections run as one GEMM each.

Scope: SpecForge 0.2.0's eagle3 step (``OnlineEagle3Model.forward`` in ``specforge.algorithms.eagle3.model``) with
the Llama draft (``LlamaForCausalLMEagle3``), whose one decoder layer (``draft_model.midlayer``) runs once per TTT
position. Its attention (every backend: sdpa, flex, fa, usp) calls ``q_proj``, ``k_proj`` and ``v_proj`` on the same
input, and its MLP (``pretraining_tp`` 1) ``gate_proj`` and ``up_proj`` on the same input. Eagerly that is three
(two) GEMMs in the forward, and in the backward three (two) input-gradient GEMMs whose outputs autograd adds with
two (one) activation-sized adds, reading two activation-sized tensors and writing one each; the key and value
projections are narrow GEMMs (8 heads of 128 on the K2.5 draft).

With ``SPECFORGE_KIMI_EAGLE3_FUSED_PROJ=1`` in the process (recipe ``trainer.step_eagle3_fused_proj``, set by
``training.step_knobs``), :func:`install_eagle3_fused_proj` wraps ``OnlineEagle3Model.forward``: while it runs with
gradients on, each group of siblings (q/k/v, gate/up: bias-free ``nn.Linear`` with one input width) runs as one
``F.linear`` over their weights concatenated on the output dimension (the concatenation made once per eagle3 forward,
a micro-batch, and reused by its every TTT position while the weights are unchanged), split back into each sibling's
output (views of the one output; the attention's key and value parts copies: :data:`GROUPS`). The first sibling called computes the group's output and returns its own part; a sibling called
next on the same input tensor (the same object, not modified in place since) gets its part of that output, once; a
sibling called on another input while parts wait runs its own ``F.linear``. So the backward runs one input-gradient GEMM and one
weight-gradient GEMM per group, with one concatenation of the siblings' output gradients instead of the adds, and the
concatenation's backward hands each sibling weight its rows of the group's weight gradient. The same mathematics: in
fp32 the losses and gradients differ by the GEMMs' summation order only; the checkpoint keeps SpecForge's own
parameters and names. It holds each group's concatenated weight for the forward and its backward (264 + 528 MB in
bf16 on the K2.5 draft) and, per position, the attention group's output until the rotary embedding has consumed the
query, besides the key and value copies the attention keeps.

Beside ``eagle3-fused-wgrad`` (``drafts.eagle3_fused_wgrad``) each group's GEMM sums its weight gradient over the
TTT positions in place as that seam's linears do (:func:`~specforge_kimi.drafts.eagle3_fused_wgrad.linear`), and
that seam leaves the siblings' ``forward`` to this one. Inside compile-elementwise's compiled regions each sibling is
a graph break, as that seam's wrapped linears are. The ``pretraining_tp > 1`` MLP calls ``F.linear`` on weight
slices itself and is left as it is. The MLA draft (``drafts.mla_eagle3``) fuses its MLP's gate/up and its
attention's two down-projections ``q_a_proj`` / ``kv_a_proj_with_mqa`` (one input; SGLang serves them fused as
``fused_qkv_a_proj_with_mqa``) the same way.

Without the variable (or with ``0``) nothing is replaced. :func:`uninstall_eagle3_fused_proj` puts SpecForge's
forward back and the siblings' own ``forward`` (tests).
"""

from __future__ import annotations

import contextlib
import os
import threading

import specforge_kimi.environment as _env
from specforge_kimi.drafts import eagle3_forward_chain

FUSED_PROJ_ENV = _env.EAGLE3_FUSED_PROJ.name
_FLAG = "__specforge_kimi_fused_proj__"
#: the attribute a sibling carries: (its group, its index in the group, its own name in the draft)
_MEMBER = "_specforge_kimi_fused_proj_member"
#: the sibling groups: the attribute names, in output order, of linears one module calls on one input, and the
#: indices of the parts handed out as copies of their own. A view keeps the whole group output alive: the attention
#: keeps its key and value (the KV cache of the TTT positions, saved for the backward) while the query is consumed
#: by the rotary embedding, so the narrow key and value parts are copied (2 x 1,024 columns on the K2.5 draft) and
#: the group output is freed with the query; the MLP's parts, and the MLA down-projections' (each normed, the norms
#: saving their inputs), are all kept by the backward anyway.
GROUPS = (
    (("q_proj", "k_proj", "v_proj"), (1, 2)),
    (("gate_proj", "up_proj"), ()),
    (("q_a_proj", "kv_a_proj_with_mqa"), ()),
)
#: SpecForge's ``OnlineEagle3Model.forward`` while the seam is installed
_ORIGINAL: list = []
#: the siblings whose ``forward`` the seam set (weak: a freed draft is not kept alive)
_WRAPPED: list = []
#: the step state of the eagle3 forward running on this thread (None outside it)
_ACTIVE = threading.local()
#: the sibling forward, built on first use (torch imported lazily)
_IMPL: dict = {}


def requested() -> bool:
    """Whether this process was asked for the seam (the variable is ``1``)."""
    return os.environ.get(FUSED_PROJ_ENV, "0") == "1"


class _Group:
    """One group of siblings: its name (``midlayer.self_attn.q_proj+k_proj+v_proj``), its modules (weak) in output
    order, their output widths and the parts handed out as copies (:data:`GROUPS`)."""

    __slots__ = ("name", "members", "widths", "copied", "__weakref__")

    def __init__(self, name: str, members: list, widths: list[int], copied: tuple[int, ...]):
        self.name, self.members, self.widths, self.copied = name, members, widths, copied

    def modules(self) -> list | None:
        """The sibling modules, or None when one of them is gone."""
        mods = [ref() for ref in self.members]
        return None if any(m is None for m in mods) else mods


class _Step:
    """One eagle3 forward's state: each group's concatenated weight (with the identities and versions it was made
    from) and each group's outputs not yet handed to their sibling (with the input they were computed on)."""

    __slots__ = ("weights", "pending", "fused_calls", "own_calls")

    def __init__(self):
        self.weights: dict = {}
        self.pending: dict = {}
        self.fused_calls = 0
        self.own_calls = 0  # siblings that ran their own linear inside the forward (SpecForge's drafts: none)


def _weight(step: _Step, group: _Group, mods: list):
    """The group's weights concatenated on the output dimension: made once per step while they are unchanged."""
    import torch

    key = tuple((id(m.weight), m.weight._version) for m in mods)
    made = step.weights.get(id(group))
    if made is None or made[0] != key:
        made = step.weights[id(group)] = (key, torch.cat([m.weight for m in mods], dim=0))
    return made[1]


def _impl():
    if _IMPL:
        return _IMPL
    import torch

    from specforge_kimi.drafts import eagle3_fused_wgrad

    @torch.compiler.disable
    def sibling_forward(module, input):  # nn.Linear.forward's own parameter name
        """A sibling's ``forward``: its part of the group's one GEMM inside the eagle3 forward, else its own linear."""
        group, index, own = getattr(module, _MEMBER)
        step = getattr(_ACTIVE, "step", None)
        if step is None or not torch.is_grad_enabled():
            return eagle3_fused_wgrad.linear(input, module.weight, key=module, name=own)
        pending = step.pending.get(id(group))
        if pending is not None:
            if pending[0] is input and pending[1] == input._version and index in pending[2]:
                part = pending[2].pop(index)
                if not pending[2]:
                    del step.pending[id(group)]
                return part
            if pending[1] == pending[0]._version:  # the parts still wait for their input: left to it
                step.own_calls += 1
                return eagle3_fused_wgrad.linear(input, module.weight, key=module, name=own)
        mods = group.modules()
        if mods is None:
            step.own_calls += 1
            return eagle3_fused_wgrad.linear(input, module.weight, key=module, name=own)
        out = eagle3_fused_wgrad.linear(input, _weight(step, group, mods), key=group, name=group.name)
        parts = [p.contiguous() if i in group.copied else p for i, p in enumerate(out.split(group.widths, dim=-1))]
        step.pending[id(group)] = (input, input._version, {i: p for i, p in enumerate(parts) if i != index})
        step.fused_calls += 1
        return parts[index]

    _IMPL.update(forward=sibling_forward)
    return _IMPL


def wrap_draft_siblings(draft) -> list[str]:
    """Route each sibling group under ``draft.midlayer`` through the seam's forward (idempotent); returns the
    group names wrapped now. A group is wrapped only when every sibling is a bias-free ``nn.Linear`` and they share
    one input width."""
    import types
    import weakref

    import torch.nn as nn

    sibling_forward = _impl()["forward"]
    root = getattr(draft, "midlayer", None)
    if not isinstance(root, nn.Module):
        return []
    wrapped = []
    for prefix, holder in root.named_modules(prefix="midlayer"):
        for names, copied in GROUPS:
            mods = [getattr(holder, n, None) for n in names]
            if not all(type(m) is nn.Linear and m.bias is None for m in mods):
                continue
            if len({m.in_features for m in mods}) != 1 or any(_MEMBER in m.__dict__ for m in mods):
                continue
            name = f"{prefix}.{names[0]}+" + "+".join(names[1:])
            group = _Group(name, [weakref.ref(m) for m in mods], [m.out_features for m in mods], copied)
            for index, m in enumerate(mods):
                setattr(m, _MEMBER, (group, index, f"{prefix}.{names[index]}"))
                m.forward = types.MethodType(sibling_forward, m)
                _WRAPPED.append(weakref.ref(m))
            wrapped.append(name)
    return wrapped


def wrapped_groups(module) -> list[str]:
    """The names of the sibling groups under ``module`` that run the seam's forward (empty: none)."""
    seen: list[str] = []
    for m in module.modules():
        member = m.__dict__.get(_MEMBER)
        if member is not None and member[0].name not in seen:
            seen.append(member[0].name)
    return seen


@contextlib.contextmanager
def fusing():
    """Within it, on this thread, sibling groups run as one GEMM each (a fresh step state each time it is entered:
    one eagle3 forward's); outside it each sibling is its own linear. Yields the step state."""
    outer = getattr(_ACTIVE, "step", None)
    _ACTIVE.step = _Step()
    try:
        yield _ACTIVE.step
    finally:
        _ACTIVE.step = outer


def _forward(self, *args, **kwargs):
    """``OnlineEagle3Model.forward`` with the draft layer's sibling projections fused."""
    import torch

    original = _ORIGINAL[0]
    if not torch.is_grad_enabled():
        return original(self, *args, **kwargs)
    wrap_draft_siblings(self.draft_model)
    with fusing():
        return original(self, *args, **kwargs)


def installed(model_cls) -> bool:
    """Whether ``model_cls`` (SpecForge's ``OnlineEagle3Model``) runs the seam's forward (under another seam's too)."""
    return eagle3_forward_chain.installed(_FLAG, model_cls)


def install_eagle3_fused_proj(*, force: bool = False) -> bool:
    """Install the seam when the process asked for it (:func:`requested`) or ``force``; True when installed.
    Idempotent."""
    if not (force or requested()):
        return False
    eagle3_forward_chain.install(_forward, _FLAG, _ORIGINAL)
    return True


def uninstall_eagle3_fused_proj() -> None:
    """SpecForge's ``OnlineEagle3Model.forward`` back, and every sibling's own ``forward`` (a no-op when the seam is
    not installed)."""
    for ref in _WRAPPED:
        m = ref()
        if m is not None:
            m.__dict__.pop("forward", None)
            m.__dict__.pop(_MEMBER, None)
    _WRAPPED.clear()
    eagle3_forward_chain.uninstall(_ORIGINAL)
