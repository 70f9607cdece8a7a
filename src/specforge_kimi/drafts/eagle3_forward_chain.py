"""SpecForge's ``OnlineEagle3Model.forward`` wrapped by our step seams, one wrapper on another.

Scope: the install, the check and the removal of a seam's forward only; what each wrapper does is its seam's
(``drafts.eagle3_fused_wgrad``, ``drafts.eagle3_fused_proj``). Each wrapper carries its seam's flag and the
forward it wraps, so :func:`installed` finds a seam's wrapper under another's and a second install of the same
seam wraps nothing.
"""

from __future__ import annotations

#: the attribute of a seam's forward naming the forward it wraps
WRAPS = "__specforge_kimi_wraps__"


def _model_cls():
    from specforge.algorithms.eagle3.model import OnlineEagle3Model

    return OnlineEagle3Model


def installed(flag: str, model_cls=None) -> bool:
    """Whether ``model_cls`` (default SpecForge's ``OnlineEagle3Model``) runs the forward marked ``flag``, at any
    depth of the chain of wrappers."""
    fn = (model_cls or _model_cls()).forward
    while fn is not None:
        if getattr(fn, flag, False):
            return True
        fn = getattr(fn, WRAPS, None)
    return False


def install(wrapper, flag: str, originals: list) -> None:
    """Make ``wrapper`` (marked ``flag``) ``OnlineEagle3Model.forward``, the forward it replaces kept in
    ``originals`` (the seam's list, read by the wrapper), unless a wrapper marked ``flag`` is already in the chain."""
    cls = _model_cls()
    if installed(flag, cls):
        return
    originals[:] = [cls.forward]
    setattr(wrapper, flag, True)
    setattr(wrapper, WRAPS, originals[0])
    cls.forward = wrapper


def uninstall(originals: list) -> None:
    """Put back the forward ``originals`` holds (a no-op when it holds none). Wrappers come off in the reverse of
    their install order (tests)."""
    if originals:
        _model_cls().forward = originals.pop()
