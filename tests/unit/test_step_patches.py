"""Our SpecForge patches eagle3-keep-allocator-cache, bf16-optimizer-fused-adamw (fused AdamW in ``BF16Optimizer``)
and eagle3-fewer-host-syncs (fewer host waits in the eagle3 step), their recipe fields and the launch preflight.

The patched files are loaded from a scratch copy of the installed wheel's (``load_patched_specforge_module``);
the install is not touched. Equal results: with eagle3-keep-allocator-cache's switch off the step's loss and every gradient are
bit-identical to SpecForge's and ``torch.cuda.empty_cache`` is never called; bf16-optimizer-fused-adamw's fused AdamW leaves the
fp32 masters within 1e-6 of the foreach one after 20 steps, and a foreach checkpoint resumes under it; eagle3-fewer-host-syncs's
switch leaves the step's loss, gradients and logged metrics bit-identical while the draft vocabulary's ids are
computed once and the metrics read back in one copy. That the patches apply to the wheel and the checkout is
``test_setup_patches.py``'s.
"""

from __future__ import annotations

import copy
import sys

import pytest
import torch
from eagle3_cpu import eagle3_step

from specforge_kimi.errors import KimiInputError
from specforge_kimi.training import step_knobs

LLAMA = {
    "architectures": ["LlamaForCausalLMEagle3"],
    "model_type": "llama",
    "hidden_size": 16,
    "intermediate_size": 24,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "num_hidden_layers": 1,
    "vocab_size": 40,
    "draft_vocab_size": 12,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 64,
    "rope_theta": 10000.0,
    "pad_token_id": 0,
    "hidden_act": "silu",
}


def _draft(seed: int = 0):
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
    from transformers import LlamaConfig

    torch.manual_seed(seed)
    return LlamaForCausalLMEagle3(LlamaConfig(**LLAMA), attention_backend="sdpa")


@pytest.fixture
def patched_model_module(cpu_shims, tmp_path):
    """The patched ``model.py`` as a module of its own; its ``torch.compile``'d helpers made eager, as the CPU shims
    make the installed module's (they patch that module only)."""
    from specforge_kimi.setup.setup_patches import load_patched_specforge_module

    module = load_patched_specforge_module("specforge/algorithms/eagle3/model.py", tmp_path)
    for name, value in list(vars(module).items()):
        eager = getattr(value, "_torchdynamo_orig_callable", None)
        if eager is not None:
            setattr(module, name, eager)
    return module


@pytest.fixture
def patched_optimizer_module(tmp_path):
    from specforge_kimi.setup.setup_patches import load_patched_specforge_module

    return load_patched_specforge_module("specforge/optimizer.py", tmp_path)


def _step(model_cls, monkeypatch, value: str | None):
    """One step of a fresh seeded draft with ``SPECFORGE_EAGLE3_EMPTY_CACHE`` = value: (loss, grads, empty_cache
    calls)."""
    calls = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append(1))
    if value is None:
        monkeypatch.delenv(step_knobs.EMPTY_CACHE_ENV, raising=False)
    else:
        monkeypatch.setenv(step_knobs.EMPTY_CACHE_ENV, value)
    draft = _draft()
    loss = eagle3_step(draft, length=10, ttt=3, vocab=40, target_hidden=16, model_cls=model_cls)()
    grads = {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}
    return loss, grads, len(calls)


def test_0003_switch_off_skips_empty_cache_and_changes_nothing_else(patched_model_module, monkeypatch):
    from specforge.algorithms.eagle3.model import OnlineEagle3Model

    cls = patched_model_module.OnlineEagle3Model
    ref_loss, ref_grads, ref_calls = _step(OnlineEagle3Model, monkeypatch, None)  # SpecForge as shipped
    on_loss, on_grads, on_calls = _step(cls, monkeypatch, None)  # patched, variable unset: SpecForge's behaviour
    off_loss, off_grads, off_calls = _step(cls, monkeypatch, "0")
    assert ref_calls == on_calls == 1 and off_calls == 0
    assert ref_grads and set(ref_grads) == set(off_grads) == set(on_grads)
    for loss, grads in ((on_loss, on_grads), (off_loss, off_grads)):
        assert torch.equal(loss, ref_loss)
        assert all(torch.equal(grads[n], ref_grads[n]) for n in ref_grads)


#: a draft vocabulary scattered over the target's 40 ids (SpecForge's mask index and eagle3-fewer-host-syncs's index_select must
#: pick the same columns in the same order)
SCATTERED = [0, 3, 4, 9, 11, 17, 18, 25, 30, 33, 37, 39]


def _fewer_syncs_steps(model_cls, monkeypatch, value: str | None, steps: int = 2):
    """``steps`` forward+backward passes of one seeded draft with ``SPECFORGE_EAGLE3_FEWER_SYNCS`` = value, the
    draft vocabulary scattered: (losses, grads after the last, ``Tensor.nonzero`` calls, ``torch.tensor`` calls made
    from ``model_cls``'s module)."""
    calls = {"nonzero": 0, "tensor": 0}
    nonzero, tensor = torch.Tensor.nonzero, torch.tensor
    module = sys.modules[model_cls.__module__]

    def counted_nonzero(self, *a, **k):
        calls["nonzero"] += 1
        return nonzero(self, *a, **k)

    def counted_tensor(*a, **k):
        if sys._getframe(1).f_globals.get("__name__") == module.__name__:
            calls["tensor"] += 1
        return tensor(*a, **k)

    monkeypatch.setattr(torch.Tensor, "nonzero", counted_nonzero)
    monkeypatch.setattr(module.torch, "tensor", counted_tensor)
    if value is None:
        monkeypatch.delenv(step_knobs.FEWER_SYNCS_ENV, raising=False)
    else:
        monkeypatch.setenv(step_knobs.FEWER_SYNCS_ENV, value)
    draft = _draft()
    run = eagle3_step(draft, length=10, ttt=3, vocab=40, target_hidden=16, model_cls=model_cls, draft_ids=SCATTERED)
    losses = []
    for _ in range(steps):
        draft.zero_grad()
        losses.append(run())
    grads = {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}
    monkeypatch.undo()
    return losses, grads, calls["nonzero"], calls["tensor"]


def test_0005_switch_on_builds_on_the_device_and_changes_no_value(patched_model_module, monkeypatch):
    from specforge.algorithms.eagle3.model import OnlineEagle3Model

    cls = patched_model_module.OnlineEagle3Model
    ref_losses, ref_grads, ref_nonzero, _ = _fewer_syncs_steps(OnlineEagle3Model, monkeypatch, None)
    off_losses, off_grads, off_nonzero, off_tensor = _fewer_syncs_steps(cls, monkeypatch, None)
    on_losses, on_grads, on_nonzero, on_tensor = _fewer_syncs_steps(cls, monkeypatch, "1")
    # SpecForge's mask index counts its columns inside the op; the switch computes the ids once for both steps
    assert ref_nonzero == off_nonzero == 0 and on_nonzero == 1
    # one loss denominator per TTT position and step from a host value; none with the switch
    assert off_tensor == 3 * 2 and on_tensor == 0
    assert ref_grads and set(ref_grads) == set(off_grads) == set(on_grads)
    for losses, grads in ((off_losses, off_grads), (on_losses, on_grads)):
        assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses, strict=True))
        assert all(torch.equal(grads[n], ref_grads[n]) for n in ref_grads)


def test_0005_draft_ids_follow_an_in_place_change_of_t2d(patched_model_module):
    t2d = torch.zeros(40, dtype=torch.bool)
    t2d[SCATTERED] = True
    first = patched_model_module._draft_ids(t2d)
    assert first.tolist() == SCATTERED and patched_model_module._draft_ids(t2d) is first
    t2d[1] = True  # e.g. load_state_dict copying a new mapping in
    assert patched_model_module._draft_ids(t2d).tolist() == sorted([*SCATTERED, 1])
    replaced = torch.zeros(40, dtype=torch.bool)
    replaced[[2, 5]] = True
    t2d.data = replaced  # new storage without a version bump (what FSDP's buffer cast does)
    assert patched_model_module._draft_ids(t2d).tolist() == [2, 5]


@pytest.fixture
def patched_controller_module(tmp_path):
    from specforge_kimi.setup.setup_patches import load_patched_specforge_module

    return load_patched_specforge_module("specforge/training/controller.py", tmp_path)


@pytest.mark.parametrize("acceptance", [False, True])
def test_0005_metrics_are_read_back_once_with_the_same_values(patched_controller_module, monkeypatch, acceptance):
    from specforge.training import controller

    g = torch.Generator().manual_seed(3)
    n = 7
    raw = {
        "acc_corrects": [torch.randint(0, 50, (), generator=g).float() for _ in range(n)],
        "acc_denoms": [torch.tensor(64.0) for _ in range(n)],
        "metric_losses": torch.rand(n, generator=g),
        "metric_loss_denoms": [torch.tensor(float(64 - i)) for i in range(n)],
    }
    if acceptance:
        raw["acceptance_rates"] = torch.rand(n, generator=g)
    reads = {"item": 0, "tolist": 0}
    item, tolist = torch.Tensor.item, torch.Tensor.tolist

    def counted(name, fn):
        def wrapper(self, *a, **k):
            reads[name] += 1
            return fn(self, *a, **k)

        return wrapper

    def reduce(module):
        reads.update(item=0, tolist=0)
        with monkeypatch.context() as m:
            m.setattr(torch.Tensor, "item", counted("item", item))
            m.setattr(torch.Tensor, "tolist", counted("tolist", tolist))
            out = module._reduce_eagle3_metrics(raw, device=torch.device("cpu"), process_group=None, ploss_decay=0.8)
        return out, dict(reads)

    ref, ref_reads = reduce(controller)
    monkeypatch.setenv(step_knobs.FEWER_SYNCS_ENV, "0")
    off, _ = reduce(patched_controller_module)
    monkeypatch.setenv(step_knobs.FEWER_SYNCS_ENV, "1")
    on, on_reads = reduce(patched_controller_module)
    again, again_reads = reduce(patched_controller_module)
    assert ref_reads == ({"item": 3, "tolist": 3} if acceptance else {"item": 2, "tolist": 2})
    assert on_reads == again_reads == {"item": 0, "tolist": 1}
    assert len(patched_controller_module._PLOSS_WEIGHTS) == 1  # built at the first call, reused by the second
    assert list(ref) == list(off) == list(on) == list(again)  # same keys, same order
    assert ref == off == on == again  # the same floats, bit for bit
    assert ("acceptance_rate" in ref) is acceptance and len(ref) == 2 * n + 2 + (n + 1) * acceptance


#: a draft head wider than the draft's hidden size, as K2.5's (32k draft vocabulary over 7168): its logits are the
#: largest tensors the step keeps for the backward
WIDE = {**LLAMA, "vocab_size": 300, "draft_vocab_size": 200, "max_position_embeddings": 128}
WIDE_IDS = sorted(torch.randperm(300, generator=torch.Generator().manual_seed(1))[:200].tolist())
WIDE_LEN, WIDE_TTT = 40, 3


def _chunked_step(model_cls, monkeypatch, value: str | None, lk: str | None = None):
    """One step of a fresh seeded wide draft with ``SPECFORGE_EAGLE3_CHUNKED_LOSS`` = value: (loss, grads, metrics,
    {storage: bytes} of the tensors the autograd graph saved for the backward, parameters left out)."""
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
    from transformers import LlamaConfig

    if value is None:
        monkeypatch.delenv(step_knobs.CHUNKED_LOSS_ENV, raising=False)
    else:
        monkeypatch.setenv(step_knobs.CHUNKED_LOSS_ENV, value)
    torch.manual_seed(0)
    draft = LlamaForCausalLMEagle3(LlamaConfig(**WIDE), attention_backend="sdpa")
    run = eagle3_step(
        draft,
        length=WIDE_LEN,
        ttt=WIDE_TTT,
        vocab=300,
        target_hidden=16,
        model_cls=model_cls,
        draft_ids=WIDE_IDS,
        lk_loss_type=lk,
    )
    params = {p.untyped_storage().data_ptr() for p in draft.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = run()
    grads = {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}
    return loss, grads, run.metrics, saved


@pytest.mark.parametrize("lk", [None, "lambda"])
@pytest.mark.parametrize("chunk", ["7", "16", "40", "64"])  # 7 and 16 leave a short last chunk; 64 > the sequence
def test_0006_chunked_head_loss_gives_the_same_step_without_keeping_the_logits(
    patched_model_module, monkeypatch, chunk, lk
):
    from specforge.algorithms.eagle3.model import OnlineEagle3Model

    ref_loss, ref_grads, ref_metrics, ref_saved = _chunked_step(OnlineEagle3Model, monkeypatch, None, lk)
    loss, grads, metrics, saved = _chunked_step(patched_model_module.OnlineEagle3Model, monkeypatch, chunk, lk)
    assert ref_grads and set(grads) == set(ref_grads)
    assert torch.allclose(loss, ref_loss, rtol=1e-6, atol=0)
    for name in ref_grads:
        assert torch.allclose(grads[name], ref_grads[name], rtol=1e-4, atol=1e-7), name
    assert list(metrics) == list(ref_metrics)
    for key in ("acces", "acc_corrects", "acc_denoms", "metric_loss_denoms"):  # counts: exact
        assert all(torch.equal(a, b) for a, b in zip(metrics[key], ref_metrics[key], strict=True)), key
    for key in ("plosses", "metric_losses", "acceptance_rates"):
        assert all(
            torch.allclose(a, b, rtol=1e-6, atol=1e-7) for a, b in zip(metrics[key], ref_metrics[key], strict=True)
        ), key
    # SpecForge keeps each TTT step's whole fp32 logits [1, S, V] for the backward (with LK also their softmax);
    # chunked, the graph keeps no tensor of that size
    logits = WIDE_LEN * WIDE["draft_vocab_size"] * 4
    whole = list(ref_saved.values()).count(logits)
    assert whole == WIDE_TTT * (1 if lk is None else 2)
    assert logits not in saved.values()
    assert sum(saved.values()) <= sum(ref_saved.values()) - whole * logits


def test_0006_without_the_variable_the_step_is_specforges(patched_model_module, monkeypatch):
    """Unset or 0: the shipped head and loss, bit for bit, and the chunked path never entered."""
    from specforge.algorithms.eagle3.model import OnlineEagle3Model

    cls = patched_model_module.OnlineEagle3Model
    monkeypatch.setattr(cls, "_chunked_acc_and_loss", lambda *a, **k: pytest.fail("chunked path entered"))
    ref_loss, ref_grads, ref_metrics, _ = _chunked_step(OnlineEagle3Model, monkeypatch, None)
    for value in (None, "0"):
        loss, grads, metrics, _ = _chunked_step(cls, monkeypatch, value)
        assert torch.equal(loss, ref_loss)
        assert all(torch.equal(grads[n], ref_grads[n]) for n in ref_grads)
        for key in ("acces", "acceptance_rates", "plosses"):
            assert all(torch.equal(a, b) for a, b in zip(metrics[key], ref_metrics[key], strict=True)), key


def _train(opt_cls, monkeypatch, fused: str | None, steps: int = 20, state=None):
    """``BF16Optimizer`` over a fresh seeded bf16 model fed the same seeded gradients: (optimizer, model)."""
    if fused is None:
        monkeypatch.delenv(step_knobs.FUSED_ADAMW_ENV, raising=False)
    else:
        monkeypatch.setenv(step_knobs.FUSED_ADAMW_ENV, fused)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.Linear(48, 8)).to(torch.bfloat16)
    opt = opt_cls(model, lr=1e-3, weight_decay=0.01, max_grad_norm=0.5, total_steps=100, warmup_ratio=0.1)
    if state is not None:
        monkeypatch.setattr(sys.modules[opt_cls.__module__], "print_on_rank0", lambda *a: None)  # no process group
        opt.load_state_dict(copy.deepcopy(state))  # as read back from a checkpoint file: nothing shared
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=g).to(torch.bfloat16)
        opt.step()
    return opt, model


def test_0004_fused_adamw_matches_foreach(patched_optimizer_module, monkeypatch):
    from specforge.optimizer import BF16Optimizer

    cls = patched_optimizer_module.BF16Optimizer
    ref, ref_model = _train(BF16Optimizer, monkeypatch, None)
    unset, _ = _train(cls, monkeypatch, None)
    fused, fused_model = _train(cls, monkeypatch, "1")
    assert not ref.optimizer.defaults.get("fused") and not unset.optimizer.defaults.get("fused")
    assert fused.optimizer.defaults["fused"] is True
    for a, b in zip(ref.fp32_params, fused.fp32_params, strict=True):
        assert (a - b).abs().max().item() <= 1e-6
    # the bf16 weights are the masters rounded: at most one bf16 step apart where a master sits on a rounding edge
    for a, b in zip(ref_model.parameters(), fused_model.parameters(), strict=True):
        assert torch.allclose(a.float(), b.float(), rtol=2**-7, atol=0)
    assert float(ref.last_grad_norm) == pytest.approx(float(fused.last_grad_norm), rel=1e-6)


def test_0004_a_foreach_checkpoint_resumes_fused(patched_optimizer_module, monkeypatch):
    """A run started before the switch (foreach) resumes with it on, and continues as the foreach run would."""
    cls = patched_optimizer_module.BF16Optimizer
    first, _ = _train(cls, monkeypatch, "0", steps=5)
    state = first.state_dict()
    resumed, _ = _train(cls, monkeypatch, "1", steps=5, state=state)
    straight, _ = _train(cls, monkeypatch, "0", steps=5, state=state)
    assert resumed.optimizer.defaults["fused"] is True
    assert int(resumed.optimizer.state[resumed.fp32_params[0]]["step"]) == 10
    for a, b in zip(straight.fp32_params, resumed.fp32_params, strict=True):
        assert (a - b).abs().max().item() <= 1e-6


def test_step_env_spells_every_switch_and_names_the_patches():
    env = step_knobs.step_env(
        empty_cache=False, fused_adamw=True, alloc_conf="expandable_segments:True", fewer_syncs=True, chunked_loss=1024
    )
    assert env == {
        "SPECFORGE_EAGLE3_EMPTY_CACHE": "0",
        "SPECFORGE_ADAMW_FUSED": "1",
        "SPECFORGE_EAGLE3_FEWER_SYNCS": "1",
        "SPECFORGE_EAGLE3_CHUNKED_LOSS": "1024",
        "SPECFORGE_KIMI_EAGLE3_COMPILE_ELEMENTWISE": "0",
        "SPECFORGE_KIMI_EAGLE3_BLOCK_MASK": "0",
        "SPECFORGE_KIMI_FLEX_AUTOTUNE": "0",
        "SPECFORGE_KIMI_EAGLE3_FUSED_WGRAD": "0",
        "SPECFORGE_KIMI_EAGLE3_FUSED_PROJ": "0",
        "SPECFORGE_KIMI_EAGLE3_FA_KERNEL": "0",
        "SPECFORGE_KIMI_OPTIMIZER_FUSED_CLIP": "0",
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
    }
    assert step_knobs.patches_needed(env) == [
        step_knobs.EMPTY_CACHE_PATCH,
        step_knobs.FUSED_ADAMW_PATCH,
        step_knobs.FEWER_SYNCS_PATCH,
        step_knobs.CHUNKED_LOSS_PATCH,
    ]
    shipped = step_knobs.step_env(empty_cache=True, fused_adamw=False, alloc_conf=None)
    assert shipped == {
        "SPECFORGE_EAGLE3_EMPTY_CACHE": "1",
        "SPECFORGE_ADAMW_FUSED": "0",
        "SPECFORGE_EAGLE3_FEWER_SYNCS": "0",
        "SPECFORGE_EAGLE3_CHUNKED_LOSS": "0",
        "SPECFORGE_KIMI_EAGLE3_COMPILE_ELEMENTWISE": "0",
        "SPECFORGE_KIMI_EAGLE3_BLOCK_MASK": "0",
        "SPECFORGE_KIMI_FLEX_AUTOTUNE": "0",
        "SPECFORGE_KIMI_EAGLE3_FUSED_WGRAD": "0",
        "SPECFORGE_KIMI_EAGLE3_FUSED_PROJ": "0",
        "SPECFORGE_KIMI_EAGLE3_FA_KERNEL": "0",
        "SPECFORGE_KIMI_OPTIMIZER_FUSED_CLIP": "0",
    }
    assert step_knobs.patches_needed(shipped) == []
    from specforge_kimi.setup.setup_patches import patch_file

    for name in (
        step_knobs.EMPTY_CACHE_PATCH,
        step_knobs.FUSED_ADAMW_PATCH,
        step_knobs.FEWER_SYNCS_PATCH,
        step_knobs.CHUNKED_LOSS_PATCH,
    ):
        assert patch_file("specforge", name).is_file()


def test_recipe_fields_reach_the_specforge_processes():
    from specforge_kimi.plan.run_plan import compile_plan, load_recipe

    r = load_recipe("recipes/kimi-k25-8xb200-lowered.yaml")
    assert r.trainer.step_empty_cache is False and r.trainer.fused_adamw is True and r.trainer.cuda_alloc_conf is None
    env = dict(compile_plan(r).process_env)
    assert env["SPECFORGE_EAGLE3_EMPTY_CACHE"] == "0" and env["SPECFORGE_ADAMW_FUSED"] == "1"
    assert env["SPECFORGE_EAGLE3_FEWER_SYNCS"] == ("1" if r.trainer.step_fewer_host_syncs else "0")
    assert r.trainer.step_chunked_head_loss is None and env["SPECFORGE_EAGLE3_CHUNKED_LOSS"] == "0"  # slower: off
    assert "PYTORCH_CUDA_ALLOC_CONF" not in env
    raw = r.model_dump()
    raw["trainer"].update(
        step_empty_cache=True,
        fused_adamw=False,
        step_optimizer_fused_clip=False,  # the clip is fused AdamW's grad_scale
        cuda_alloc_conf="expandable_segments:True",
        step_fewer_host_syncs=True,
        step_eagle3_fused_wgrad=False,  # the chunked loss recomputes the head: not beside fused weight gradients
        step_chunked_head_loss=2048,
    )
    env = dict(compile_plan(raw).process_env)
    assert env["SPECFORGE_EAGLE3_EMPTY_CACHE"] == "1" and env["SPECFORGE_ADAMW_FUSED"] == "0"
    assert env["SPECFORGE_EAGLE3_FEWER_SYNCS"] == "1" and env["SPECFORGE_EAGLE3_CHUNKED_LOSS"] == "2048"
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    raw["trainer"]["step_chunked_head_loss"] = 0
    with pytest.raises(KimiInputError) as e:
        compile_plan(raw)
    assert "step_chunked_head_loss" in str(e.value)


def test_the_flex_seams_are_recipe_knobs_that_need_no_patch():
    """trainer.step_eagle3_block_mask and trainer.step_flex_autotune reach the trainer processes as our seams'
    variables ("1"), spelled "0" otherwise; they are registration seams, so no SpecForge patch is asked for."""
    import yaml

    from specforge_kimi.plan.run_plan import compile_plan

    raw = yaml.safe_load(open("recipes/kimi-k25-8xb200-lowered.yaml"))
    raw["trainer"].update(step_eagle3_block_mask=False, step_flex_autotune=False)
    env = dict(compile_plan(raw).process_env)
    assert (env[step_knobs.BLOCK_MASK_ENV], env[step_knobs.FLEX_AUTOTUNE_ENV]) == ("0", "0")
    raw["trainer"].update(step_eagle3_block_mask=True, step_flex_autotune=True)
    env = dict(compile_plan(raw).process_env)
    assert (env[step_knobs.BLOCK_MASK_ENV], env[step_knobs.FLEX_AUTOTUNE_ENV]) == ("1", "1")
    assert step_knobs.patches_needed(env) == step_knobs.patches_needed({**env, step_knobs.BLOCK_MASK_ENV: "0"})


@pytest.mark.parametrize("family", ["dflash", "dspark"])
def test_block_drafts_get_no_eagle3_step_switches(family):
    """A block draft's processes carry no eagle3 step variable (patches eagle3-keep-allocator-cache and
    eagle3-fewer-host-syncs change SpecForge's eagle3 step only), so the launch's preflight asks for neither patch;
    the optimizer's switch still applies."""
    import yaml

    from specforge_kimi.plan.run_plan import compile_plan

    raw = yaml.safe_load(open("recipes/kimi-k25-8xb200-lowered-dflash.yaml"))
    raw["trainer"]["family"] = family
    raw["trainer"]["draft"]["architectures"] = ["DSparkDraftModel" if family == "dspark" else "DFlashDraftModel"]
    plan = compile_plan(raw)
    assert plan.recipe.trainer.step_empty_cache is False  # the field's default, which the eagle3 step would read
    env = dict(plan.process_env)
    eagle3_only = {step_knobs.EMPTY_CACHE_ENV, step_knobs.FEWER_SYNCS_ENV, step_knobs.CHUNKED_LOSS_ENV}
    eagle3_only |= {
        step_knobs.COMPILE_ELEMENTWISE_ENV,
        step_knobs.BLOCK_MASK_ENV,
        step_knobs.FLEX_AUTOTUNE_ENV,
        step_knobs.FUSED_WGRAD_ENV,
        step_knobs.FUSED_PROJ_ENV,
    }
    assert not eagle3_only & set(env)
    assert env[step_knobs.FUSED_ADAMW_ENV] == "1"
    assert step_knobs.patches_needed(env) == [step_knobs.FUSED_ADAMW_PATCH]  # what the preflight checks


@pytest.mark.parametrize("bad", ["expandable_segments", "expandable_segments:True;x:1", "a:1,", " a:1", "A:1"])
def test_a_malformed_allocator_setting_is_a_one_line_recipe_error(tmp_path, bad):
    import yaml

    from specforge_kimi.plan.run_plan import load_recipe

    raw = yaml.safe_load(open("recipes/kimi-k25-8xb200-lowered.yaml"))
    raw["trainer"]["cuda_alloc_conf"] = bad
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(KimiInputError) as e:
        load_recipe(path)
    assert "cuda_alloc_conf" in str(e.value) and "key:value" in str(e.value) and "\n" not in str(e.value)


def test_launch_refuses_a_switch_whose_patch_is_missing(tmp_path, monkeypatch):
    """The preflight reads the plan's environments: the unpatched wheel is refused with the fix named; a copy with
    our patches applied passes; SpecForge's own settings need no patch."""
    import argparse
    import importlib.util
    import shutil
    from pathlib import Path
    from types import SimpleNamespace

    from specforge_kimi.run import launch
    from specforge_kimi.setup import setup_patches

    wanted = step_knobs.step_env(
        empty_cache=False, fused_adamw=True, alloc_conf=None, fewer_syncs=True, chunked_loss=512
    )
    plan = SimpleNamespace(commands=[SimpleNamespace(env={}), SimpleNamespace(env=wanted)])
    patched = tmp_path / "sf"
    shutil.copytree(
        Path(importlib.util.find_spec("specforge").origin).parent,
        patched / "specforge",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    monkeypatch.setattr(setup_patches, "specforge_root", lambda checkout: Path(patched))
    with pytest.raises(KimiInputError) as e:
        launch.trainer_step_preflight(plan)
    msg = str(e.value)
    for name in (
        step_knobs.EMPTY_CACHE_PATCH,
        step_knobs.FUSED_ADAMW_PATCH,
        step_knobs.FEWER_SYNCS_PATCH,
        step_knobs.CHUNKED_LOSS_PATCH,
    ):
        assert f"SpecForge patch {name} is not applied" in msg, msg
    assert "specforge-kimi setup" in msg
    assert "\n" not in msg
    assert setup_patches.run(argparse.Namespace(specforge_checkout=str(patched), check=False, no_sglang=True)) == 0
    launch.trainer_step_preflight(plan)
    monkeypatch.setattr(setup_patches, "specforge_root", lambda checkout: Path(tmp_path / "nowhere"))
    shipped = step_knobs.step_env(empty_cache=True, fused_adamw=False, alloc_conf=None)
    launch.trainer_step_preflight(SimpleNamespace(commands=[SimpleNamespace(env=shipped)]))
