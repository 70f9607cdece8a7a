"""``specforge-kimi demo --draft dflash``: the demo's block-draft twin (DFlash) on the same tiny target and features.

Scope: after the demo's steps 1-4 (:func:`specforge_kimi.demo.pipeline.prepare_inputs`: the pretrained tiny K2.5,
the reference-hook capture), a DFlash draft (SpecForge's ``DFlashDraftModel``, one Qwen3-style layer at the target's
width over the N target layers :data:`DEMO_DFLASH_IDS` names) is trained by SpecForge's own trainer
(:func:`specforge_kimi.training.offline.train_offline`, ``strategy="dflash"``) on feature files holding
``hidden_states`` [1, S, N*H], exported with the DFlash export and its check (:mod:`specforge_kimi.drafts.
block_export`), and measured.

What is measured (``decode_acceptance``): greedy speculative decoding of the held-out prompts (each held-out
conversation cut where its first answer starts) on the tiny target in transformers, ``decode_tokens`` new tokens
each, by SpecForge's own ``DFlashDraftModel.spec_generate`` (temperature 0; the target passed is the text model,
whose ``model.embed_tokens`` and ``lm_head`` the draft uses). The target's head is restricted to the demo's draft
vocabulary (the training data's tokens and K2.5's emitted specials) for both target and draft: a full-vocabulary
head read per call would make the CPU decode slow, and the tiny target is trained on that vocabulary only. Each verify forward of a block is observed and its
acceptance length computed exactly as ``spec_generate`` computes it (1 + the drafted tokens matching the target's
argmax, up to the first miss); reported is the mean over all rounds of all prompts, before (the draft as SpecForge
initialises it, same seed) and after training (the exported draft, read back from the export). At most
``block_size`` per round. The EAGLE-3 demo reports the same measure on the same prompts
(:func:`eagle3_decode_acceptance`), so ``demo --draft both`` prints the pair.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

#: DFlash ids of the demo's 6-layer target (capture after layer ``id``): positions [2, 3, 4], the layers the
#: EAGLE-3 demo captures (SpecForge ids 1, 2, 3), so one capture feeds both drafts
DEMO_DFLASH_IDS = (1, 2, 3)


def dflash_draft_config(hidden: int, num_layers: int, block_size: int, mask_token_id: int) -> dict:
    """The demo's DFlash draft: one Qwen3-style layer at the target's width (its noise is embedded with the target's
    embedding), :data:`DEMO_DFLASH_IDS`, the K2.5 mask token."""
    from specforge_kimi.demo.draft_steps import one_layer_draft

    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        **one_layer_draft(hidden),
        "layer_types": ["full_attention"],
        "attention_bias": False,
        "rms_norm_eps": 1e-6,
        "block_size": block_size,
        "num_target_layers": num_layers,
        "dflash_config": {"target_layer_ids": list(DEMO_DFLASH_IDS), "mask_token_id": mask_token_id},
        "torch_dtype": "float32",
    }


def heldout_prompts(held: list[dict]) -> list:
    """Each held-out sample's ids up to its first trained (answer) token: the prompt a user would send."""
    prompts = []
    for s in held:
        mask = s["loss_mask"].reshape(-1).tolist()
        if 1 in mask and mask.index(1) > 0:
            prompts.append(s["input_ids"].reshape(-1)[: mask.index(1)].clone())
    if not prompts:
        raise ValueError("no held-out sample has a prompt before its answer")
    return prompts


def draft_vocab_ids(inp):
    """The demo's draft vocabulary (the EAGLE-3 draft's: the training data's tokens and K2.5's emitted specials) as
    sorted target ids: the tokens the decode measurement lets the target and the drafts emit."""
    import torch

    return torch.load(inp.vm_path, weights_only=True)["t2d"].bool().nonzero().reshape(-1)


class _RestrictedHead:
    """The target's LM head over ``ids`` only, its logits scattered into the full vocabulary (-inf elsewhere), so an
    argmax picks the best of ``ids`` as a target id; reads a small slice of the head per call, not all of it."""

    def __init__(self, head_w, ids, vocab: int):
        self.w, self.ids, self.vocab = head_w[ids].float(), ids, vocab

    def __call__(self, hidden):
        import torch

        full = torch.full((*hidden.shape[:-1], self.vocab), float("-inf"), dtype=hidden.dtype)
        full[..., self.ids] = hidden @ self.w.T.to(hidden.dtype)
        return full


class _ObservedTarget:
    """The target as ``spec_generate`` uses it (``device``, ``model.embed_tokens``, ``lm_head``, calls), its head
    restricted to the draft vocabulary (:class:`_RestrictedHead`), recording each block verify's acceptance length as
    ``spec_generate`` computes it at temperature 0."""

    def __init__(self, model, block_size: int, inp):
        self._model, self._block = model, block_size
        self.device, self.model = model.device, model.model
        self.lm_head = _RestrictedHead(inp.head_w, draft_vocab_ids(inp), inp.info.vocab_size)
        self.lengths: list[int] = []

    def __call__(self, input_ids, *, logits_to_keep=None, **kwargs):
        from types import SimpleNamespace

        kwargs.pop("output_hidden_states", None)
        out = self.model(input_ids, output_hidden_states=True, **kwargs)
        hidden = out.last_hidden_state if logits_to_keep is None else out.last_hidden_state[:, -logits_to_keep:]
        logits = self.lm_head(hidden)
        if logits_to_keep is None and input_ids.shape[1] == self._block:  # a verify, not the prefill
            posterior = logits.argmax(-1)
            hits = (input_ids[:, 1:] == posterior[:, :-1]).long().cumprod(dim=1).sum(dim=1)
            self.lengths.append(int(hits[0]) + 1)
        return SimpleNamespace(logits=logits, hidden_states=out.hidden_states)


def block_acceptance(draft, target, inp, prompts, max_new_tokens: int) -> dict:
    """Greedy speculative decoding of ``prompts`` by ``draft.spec_generate`` on ``target`` (a transformers causal
    LM, its head restricted to the draft vocabulary); the acceptance length per round, averaged over all rounds."""
    import torch

    observed = _ObservedTarget(target, draft.block_size, inp)
    with torch.no_grad():
        for p in prompts:
            draft.spec_generate(observed, p.reshape(1, -1), max_new_tokens, None, 0.0)
    lengths = observed.lengths
    return {
        "mean_acceptance_length": sum(lengths) / len(lengths),
        "rounds": len(lengths),
        "prompts": len(prompts),
        "max_per_round": int(draft.block_size),
        "at_least": [sum(n >= j + 2 for n in lengths) / len(lengths) for j in range(draft.block_size - 1)],
    }


def greedy_decode(target, inp, prompt, max_new_tokens: int) -> list[int]:
    """``prompt`` and the target's greedy continuation (head restricted as in :func:`block_acceptance`)."""
    import torch
    from transformers import DynamicCache

    observed, cache = _ObservedTarget(target, 0, inp), DynamicCache()
    ids = prompt.reshape(1, -1)
    out = observed(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    generated = [int(out.logits[0, -1].argmax())]
    while len(generated) < max_new_tokens:
        pos = torch.tensor([[ids.shape[1] + len(generated) - 1]])
        out = observed(torch.tensor([generated[-1:]]), position_ids=pos, past_key_values=cache, use_cache=True)
        generated.append(int(out.logits[0, -1].argmax()))
    return ids[0].tolist() + generated


def load_dflash(config: dict, state: dict | None = None, seed: int = 0):
    """SpecForge's ``DFlashDraftModel`` from ``config`` (fp32, sdpa), randomly initialised with ``seed`` as
    SpecForge builds it, or filled from ``state`` (every key, strictly)."""
    import torch
    from specforge.modeling.draft.dflash import DFlashDraftModel
    from transformers import Qwen3Config

    cfg = Qwen3Config(**{k: v for k, v in config.items() if k != "torch_dtype"})
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = DFlashDraftModel(cfg).float()
    if state is not None:
        model.load_state_dict(state, strict=True)
    return model.eval()


def load_exported(export_dir: Path):
    """The exported DFlash draft read back from ``config.json`` + ``*.safetensors`` (what SGLang loads)."""
    from safetensors.torch import load_file

    config = json.loads((export_dir / "config.json").read_text())
    state: dict = {}
    for f in sorted(export_dir.glob("*.safetensors")):
        state.update({k: v.float() for k, v in load_file(str(f)).items()})
    return load_dflash(config, state)


def decode_samples(inp, max_new_tokens: int, capture_samples) -> list[dict]:
    """The target's own greedy continuation of each held-out prompt (``max_new_tokens``), captured with the reference
    hooks as SpecForge offline samples by ``capture_samples`` (the demo's; the continuation loss-masked), the
    target's greedy tokens cached."""
    import torch

    from specforge_kimi.targets.checkpoint import load_text_model

    target = load_text_model(inp.target_dir).eval()
    rows = []
    with torch.no_grad():
        for p in heldout_prompts(inp.held):
            ids = greedy_decode(target, inp, p, max_new_tokens)
            rows.append((ids, [0] * len(p) + [1] * (len(ids) - len(p))))
    samples = [s for _, s in sorted(capture_samples(target, rows, inp.aux, inp.feat_dtype), key=lambda x: x[0])]
    vocab = draft_vocab_ids(inp)
    head = inp.head_w[vocab]
    for s in samples:  # the target's greedy tokens under the same restricted head
        s["target_greedy"] = vocab[(s["hidden_state"].reshape(-1, head.shape[1]).float() @ head.T).argmax(-1)]
    return samples


def eagle3_decode_acceptance(draft, inp, samples: list[dict], steps: int) -> dict:
    """An EAGLE-3 draft's acceptance over the decode rounds of :func:`decode_samples`
    (:func:`specforge_kimi.evaluate.simulate.serving_rounds`): on the target's own greedy text, what greedy chain
    speculation (top-k 1, ``steps`` drafts) accepts."""
    from specforge_kimi.evaluate.simulate import simulated_acceptance

    r = simulated_acceptance(draft, inp.head_w, samples, steps)
    return {
        "mean_acceptance_length": r.serving_acceptance_length,
        "rounds": r.serving_rounds,
        "prompts": len(samples),
        "max_per_round": steps + 1,
        "at_least": r.serving_at_least,
    }


def _train(s, inp, say, log: Path, steps, cfg_path: Path) -> dict:
    """SpecForge's own DFlash training on the captured features (``hidden_states``), its steps on ``steps.bar``."""
    from specforge_kimi.demo.draft_steps import train_draft
    from specforge_kimi.plan.recipes import K25_MASK_TOKEN_ID

    return train_draft(
        s,
        inp,
        say,
        log,
        steps,
        family="DFlash",
        detail=f"block {s.block_size}",
        draft_config_path=cfg_path,
        vocab_mapping_path=None,
        output_dir=inp.out / "train-dflash",
        strategy="dflash",
        extra_overrides={"model.mask_token_id": K25_MASK_TOKEN_ID, "training.num_anchors": s.num_anchors},
    )


def train_evaluate_export(s, inp, say, lap, timings: dict, t0: float, log: Path, steps, base_summary) -> dict:
    """The dflash demo's steps 4-6: the untrained draft's acceptance, SpecForge's training, the export and its check,
    the exported draft's acceptance; returns the summary (``demo_result.json``'s keys, ``draft_family: dflash``)."""
    from specforge_kimi.drafts.block_export import check_dflash_export
    from specforge_kimi.drafts.export import export_run_draft
    from specforge_kimi.plan.recipes import K25_MASK_TOKEN_ID
    from specforge_kimi.targets.checkpoint import load_text_model

    out, t = inp.out, inp.since
    config = dflash_draft_config(inp.info.hidden_size, inp.info.num_layers, s.block_size, K25_MASK_TOKEN_ID)
    cfg_path = out / "draft_config_dflash.json"
    cfg_path.write_text(json.dumps(config, indent=2))
    target = load_text_model(inp.target_dir).eval()
    prompts = heldout_prompts(inp.held)
    before = block_acceptance(load_dflash(config, seed=s.seed), target, inp, prompts, s.decode_tokens)
    say(
        f"[4/6] untrained DFlash draft: acceptance length {before['mean_acceptance_length']:.3f} "
        f"(greedy decode, block {s.block_size}, {before['rounds']} rounds over {len(prompts)} held-out prompts)"
    )
    t = lap("eval_before", t)
    result = _train(s, inp, say, log, steps, cfg_path)
    t = lap("train", t)
    export_dir = out / "export-dflash"
    export_run_draft(
        result["checkpoint_dir"],
        cfg_path,
        export_dir,
        vocab_mapping_path="",
        target_dir=inp.target_dir,
        aux=None,
        mask_token_id=K25_MASK_TOKEN_ID,
        extra={"demo": {"steps": s.steps, "seed": s.seed}},
    )
    check = check_dflash_export(export_dir, inp.target_dir)
    t = lap("export", t)
    after = block_acceptance(load_exported(export_dir), target, inp, prompts, s.decode_tokens)
    lap("eval_after", t)
    summary = base_summary(s, inp, result, _losses_gain(result, before, after), export_dir, "dflash")
    return _summary(summary, before, after, check, timings, t0)


def _losses_gain(result: dict, before: dict, after: dict) -> tuple[float, float, float]:
    """Mean training loss over the first and last fifth (at most 50 steps each) and the acceptance gain."""
    from specforge_kimi.demo.draft_steps import loss_means

    _, first, last = loss_means(result["losses"])
    return first, last, after["mean_acceptance_length"] - before["mean_acceptance_length"]


def _summary(summary: dict, before: dict, after: dict, check: dict, timings: dict, t0: float) -> dict[str, Any]:
    """``demo_result.json`` for the DFlash draft: the EAGLE-3 demo's keys (``summary``, the demo's base summary)
    with the decode acceptance, ``draft_family`` and ``export_check``."""
    gain = after["mean_acceptance_length"] - before["mean_acceptance_length"]
    summary["ok"] = bool(summary["train"]["loss_last_mean"] < summary["train"]["loss_first_mean"] and gain > 0)
    summary["target"]["dflash_target_layer_ids"] = list(DEMO_DFLASH_IDS)
    summary["decode_acceptance"] = {
        "before": before,
        "after": after,
        "gain": gain,
        "what": "greedy speculative decoding of the held-out prompts on the tiny target (transformers) by "
        "SpecForge's DFlashDraftModel.spec_generate; per round 1 + drafted tokens matching the target's argmax up to "
        "the first miss, averaged over all rounds; target and draft argmax over the demo's draft vocabulary (the "
        "training data's tokens and K2.5's emitted specials), not the full K2.5 vocabulary; after = the exported draft "
        "read back",
    }
    summary["simulated_acceptance"] = {
        "before": before["mean_acceptance_length"],
        "after": after["mean_acceptance_length"],
        "gain": gain,
        "what": "the decode_acceptance means (a block draft has no teacher-forced chain)",
    }
    summary["heldout_loss"] = None
    summary["export_check"] = check
    summary["timings_s"] = {**timings, "total": round(time.monotonic() - t0, 2)}
    return summary
