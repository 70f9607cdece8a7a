"""The flex-autotune seam on the CPU: installed, SpecForge's flex attention singleton hands out flex attention
compiled with max-autotune-no-cudagraphs (a singleton made before the seam too); uninstalled, SpecForge's own;
not requested, nothing changes. The numbers are compared on the GPU (PyTorch's flex attention has no CPU backward):
``bench/trainer_memory.py --variants recipe,flex_autotune`` records each variant's losses."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("specforge")

from specforge_kimi.drafts import flex_autotune as seam  # noqa: E402


@pytest.fixture
def recorded_compile(monkeypatch):
    import specforge.modeling.draft.llama3_eagle  # noqa: F401  (its import-time decorators compile for real)

    calls = []

    def fake_compile(fn=None, **kw):
        if fn is None:  # a decorator form: leave the function as it is
            return lambda f: f
        calls.append((fn, kw))

        def compiled(*args, **kwargs):  # a plain function, as torch.compile returns: it would bind as a method
            return ("compiled", fn, kw.get("mode"), args, kwargs)

        compiled.mode = kw.get("mode")
        return compiled

    monkeypatch.setattr(torch, "compile", fake_compile)
    yield calls
    seam.uninstall_flex_autotune()


def test_installed_the_singleton_is_autotuned(recorded_compile):
    from specforge.modeling.draft.flex_attention import WrappedFlexAttention, compile_friendly_flex_attention
    from torch.nn.attention.flex_attention import flex_attention

    before = (WrappedFlexAttention._is_flex_compiled, WrappedFlexAttention._compiled_flex_attention)
    assert seam.install_flex_autotune(force=True) and seam.installed()
    assert recorded_compile == [(flex_attention, {"mode": "max-autotune-no-cudagraphs"})]
    assert WrappedFlexAttention()().mode == "max-autotune-no-cudagraphs"
    assert len(recorded_compile) == 1  # SpecForge's __init__ compiled nothing of its own
    assert seam.install_flex_autotune(force=True) and len(recorded_compile) == 1  # once per process
    # SpecForge's flex layer calls the singleton's function with the tensors as they are: nothing bound in front
    q, k, v = torch.zeros(1), torch.ones(1), torch.full((1,), 2.0)
    out = compile_friendly_flex_attention(q, k, v, enable_gqa=True)
    assert out[:3] == ("compiled", flex_attention, "max-autotune-no-cudagraphs")
    assert out[3] == (q, k, v) and out[4] == {"enable_gqa": True}
    seam.uninstall_flex_autotune()
    assert (WrappedFlexAttention._is_flex_compiled, WrappedFlexAttention._compiled_flex_attention) == before
    assert not seam.installed()


def test_a_singleton_made_before_the_seam_gets_the_autotuned_function(recorded_compile):
    from specforge.modeling.draft.flex_attention import WrappedFlexAttention

    instance = WrappedFlexAttention()  # SpecForge's own compile (recorded too)
    assert recorded_compile[-1][1] == {}
    seam.install_flex_autotune(force=True)
    assert instance() is WrappedFlexAttention._compiled_flex_attention
    assert instance().mode == "max-autotune-no-cudagraphs"
    assert instance()(1, 2)[3] == (1, 2)
    seam.uninstall_flex_autotune()
    assert "_compiled_flex_attention" not in vars(instance)
    WrappedFlexAttention._instance = None  # leave no singleton of a faked compile to other tests


def test_not_requested_nothing_changes(monkeypatch):
    monkeypatch.delenv(seam.AUTOTUNE_ENV, raising=False)
    assert seam.install_flex_autotune() is False and not seam.installed()
    monkeypatch.setenv(seam.AUTOTUNE_ENV, "0")
    assert seam.install_flex_autotune() is False
