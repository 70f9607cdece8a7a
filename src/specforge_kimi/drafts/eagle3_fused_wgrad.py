"""The ``eagle3-fused-wgrad`` seam: a draft weight's gradient over the TTT positions summed inside its wgrad GEMM.

Scope: SpecForge 0.2.0's eagle3 step (``OnlineEagle3Model.forward`` in ``specforge.algorithms.eagle3.model``), which
runs the draft's decoder layer (``draft_model.midlayer``) and its head (``draft_model.lm_head``) once per TTT
position. Every bias-free ``nn.Linear`` of those two modules (the Llama draft: q/k/v/o, gate/up/down and the head)
is therefore used ``ttt_length`` times a step, and autograd computes ``ttt_length`` weight gradients, one GEMM each,
and sums them with ``ttt_length - 1`` weight-sized adds, each reading two weight-sized tensors and writing one.
Beside ``eagle3-fused-proj`` the sibling projections (q/k/v, gate/up) are that seam's, one GEMM per group, whose
weight gradient it sums here through :func:`linear`.

With ``SPECFORGE_KIMI_EAGLE3_FUSED_WGRAD=1`` in the process (recipe ``trainer.step_eagle3_fused_wgrad``, set by
``training.step_knobs``), :func:`install_eagle3_fused_wgrad` wraps ``OnlineEagle3Model.forward``: while it runs with
gradients on, those linears run the seam's autograd function (under autocast for their device, ``F.linear``). Its
forward is ``F.linear``; its backward computes the input gradient as ``F.linear``'s does and adds the weight gradient
into one buffer per weight and step with the GEMM itself (``addmm_``: the add in the GEMM's epilogue, no separate
pass). The use whose backward runs last (a count per weight: uses in the forward, minus backwards run) hands the
buffer to autograd as that use's weight gradient; the others hand none. So whatever sits behind the weight -- a leaf
parameter, FSDP's flat parameter (``use_orig_params``), DDP's bucket -- receives one gradient per weight and step:
the same sum. In fp32 the sums differ by rounding only; in bf16 each position's product is rounded once, into the
sum, where autograd rounds it and then the sum.

A use whose backward never ran would keep its weight's sum from autograd; a check queued on the backward pass raises
at its end, naming the weight, instead of training on a lost gradient. Not under activation checkpointing that
recomputes a wrapped linear in the backward (outside the eagle3 forward, so as ``F.linear``: PyTorch's
non-reentrant checkpoint refuses the mismatch): ``trainer.step_chunked_head_loss`` recomputes the head that way, and
the recipe refuses the pair. The ``pretraining_tp > 1`` MLP calls ``F.linear`` on weight slices itself and keeps
autograd's sums. Inside compile-elementwise's compiled regions each wrapped linear is a graph break (the wrapped
forward runs eagerly); the regions' elementwise fusions stay.

Without the variable (or with ``0``) nothing is replaced. :func:`uninstall_eagle3_fused_wgrad` puts SpecForge's
forward back and the linears' own ``forward`` (tests).
"""

from __future__ import annotations

import contextlib
import os
import threading

import specforge_kimi.environment as _env
from specforge_kimi.drafts import eagle3_forward_chain

FUSED_WGRAD_ENV = _env.EAGLE3_FUSED_WGRAD.name
_FLAG = "__specforge_kimi_fused_wgrad__"
#: the attribute a wrapped linear carries: its name in the draft, for the check's message
_NAME = "_specforge_kimi_wgrad_name"
#: SpecForge's ``OnlineEagle3Model.forward`` while the seam is installed
_ORIGINAL: list = []
#: the linears whose ``forward`` the seam set (weak: a freed draft is not kept alive)
_WRAPPED: list = []
#: the accumulators of the eagle3 forward running on this thread (None outside it)
_ACTIVE = threading.local()
#: the autograd Function and the linear forward, built on first use (torch imported lazily)
_IMPL: dict = {}


def requested() -> bool:
    """Whether this process was asked for the seam (the variable is ``1``)."""
    return os.environ.get(FUSED_WGRAD_ENV, "0") == "1"


class _Sum:
    """One weight's gradient sum over one forward's uses: ``pending`` backwards still to run, ``buf`` the sum."""

    __slots__ = ("name", "uses", "pending", "buf")

    def __init__(self, name: str):
        self.name, self.uses, self.pending, self.buf = name, 0, 0, None


def _check(acc: _Sum) -> None:
    """At the end of a backward pass: every use ran its backward (``pending`` 0) and the sum was handed on. A second
    pass over the same graph (``retain_graph``, ``create_graph``) drives ``pending`` below 0: each of its uses then
    hands its own product, autograd's own sums, which is correct."""
    if acc.pending > 0 or acc.buf is not None:
        uses, acc.buf = acc.uses, None
        raise RuntimeError(
            f"eagle3-fused-wgrad: {acc.pending} of {uses} uses of {acc.name} ran no backward in this pass, so its "
            "weight gradient cannot be handed on whole; set trainer.step_eagle3_fused_wgrad: false"
        )


def _impl():
    if _IMPL:
        return _IMPL
    import torch
    import torch.nn.functional as F

    class AccumulatingLinear(torch.autograd.Function):
        """``F.linear(x, weight)`` whose weight gradients, over the uses sharing one :class:`_Sum`, add up in place."""

        @staticmethod
        def forward(ctx, x, weight, acc):
            ctx.save_for_backward(x, weight)
            ctx.acc = acc
            return F.linear(x, weight)

        @staticmethod
        def backward(ctx, grad_out):
            x, weight = ctx.saved_tensors
            acc = ctx.acc
            grad_x = grad_out.matmul(weight) if ctx.needs_input_grad[0] else None
            g = grad_out.reshape(-1, grad_out.shape[-1]).t()
            x2 = x.reshape(-1, x.shape[-1])
            if acc.buf is None:
                acc.buf = g.mm(x2)
                torch.autograd.Variable._execution_engine.queue_callback(lambda: _check(acc))
            else:
                acc.buf.addmm_(g, x2)
            acc.pending -= 1
            if acc.pending > 0:
                return grad_x, None, None
            grad_w, acc.buf = acc.buf, None
            return grad_x, grad_w, None

    def linear(input, weight, key, name):
        """``F.linear(input, weight)``; inside :func:`summing` with gradients on (and no autocast) the accumulating
        function, the uses of one ``key`` sharing one sum."""
        accs = getattr(_ACTIVE, "accs", None)
        if (
            accs is None
            or not (weight.requires_grad and torch.is_grad_enabled())
            or torch.is_autocast_enabled(weight.device.type)
        ):
            return F.linear(input, weight)
        acc = accs.get(id(key))
        if acc is None:
            acc = accs[id(key)] = _Sum(name)
        acc.uses += 1
        acc.pending += 1
        return AccumulatingLinear.apply(input, weight, acc)

    @torch.compiler.disable
    def linear_forward(module, input):  # nn.Linear.forward's own parameter name
        """A wrapped linear's ``forward``: the accumulating function inside the eagle3 forward, else ``F.linear``."""
        return linear(input, module.weight, module, getattr(module, _NAME))

    _IMPL.update(function=AccumulatingLinear, forward=linear_forward, linear=linear)
    return _IMPL


def linear(input, weight, *, key, name: str):
    """``F.linear(input, weight)`` (no bias) for another seam's GEMM of the eagle3 draft (``drafts.eagle3_fused_proj``):
    inside this seam's eagle3 forward its weight gradient is summed in place over the uses of ``key`` (an object
    alive for the step, one per weight) like a wrapped linear's, ``name`` naming it in the check's message; outside it
    ``F.linear``."""
    return _impl()["linear"](input, weight, key, name)


def wrap_draft_linears(draft) -> list[str]:
    """Route the bias-free ``nn.Linear`` modules of ``draft.midlayer`` and ``draft.lm_head`` through the seam's
    forward (idempotent); returns the names of those it wraps now. A linear whose ``forward`` another seam set
    (``drafts.eagle3_fused_proj``'s siblings, which sum through :func:`linear`) is left to it."""
    import types
    import weakref

    import torch.nn as nn

    linear_forward = _impl()["forward"]
    wrapped = []
    for part in ("midlayer", "lm_head"):
        root = getattr(draft, part, None)
        if not isinstance(root, nn.Module):
            continue
        for name, m in root.named_modules(prefix=part):
            if type(m) is nn.Linear and m.bias is None and not hasattr(m, _NAME) and "forward" not in m.__dict__:
                setattr(m, _NAME, name)
                m.forward = types.MethodType(linear_forward, m)
                _WRAPPED.append(weakref.ref(m))
                wrapped.append(name)
    return wrapped


def wrapped_names(module) -> list[str]:
    """The draft names of the linears under ``module`` that run the seam's forward (empty: none)."""
    return [getattr(m, _NAME) for m in module.modules() if _NAME in m.__dict__]


@contextlib.contextmanager
def summing():
    """Within it, on this thread, a wrapped linear's uses share one weight-gradient sum per linear (a fresh set of
    sums each time it is entered: one eagle3 forward's); outside it a wrapped linear is ``F.linear``."""
    outer = getattr(_ACTIVE, "accs", None)
    _ACTIVE.accs = {}
    try:
        yield
    finally:
        _ACTIVE.accs = outer


def _forward(self, *args, **kwargs):
    """``OnlineEagle3Model.forward`` with the draft's linears summing their weight gradients in place."""
    import torch

    original = _ORIGINAL[0]
    if not torch.is_grad_enabled():
        return original(self, *args, **kwargs)
    wrap_draft_linears(self.draft_model)
    with summing():
        return original(self, *args, **kwargs)


def installed(model_cls) -> bool:
    """Whether ``model_cls`` (SpecForge's ``OnlineEagle3Model``) runs the seam's forward (under another seam's too)."""
    return eagle3_forward_chain.installed(_FLAG, model_cls)


def install_eagle3_fused_wgrad(*, force: bool = False) -> bool:
    """Install the seam when the process asked for it (:func:`requested`) or ``force``; True when installed.
    Idempotent."""
    if not (force or requested()):
        return False
    eagle3_forward_chain.install(_forward, _FLAG, _ORIGINAL)
    return True


def uninstall_eagle3_fused_wgrad() -> None:
    """SpecForge's ``OnlineEagle3Model.forward`` back, and every wrapped linear's own ``forward`` (a no-op when the
    seam is not installed)."""
    for ref in _WRAPPED:
        m = ref()
        if m is not None:
            m.__dict__.pop("forward", None)
            m.__dict__.pop(_NAME, None)
    _WRAPPED.clear()
    eagle3_forward_chain.uninstall(_ORIGINAL)
