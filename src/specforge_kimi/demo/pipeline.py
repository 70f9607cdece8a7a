"""``specforge-kimi demo``: the whole K2.5 draft pipeline on a 2-core CPU, in a few minutes.

Scope: the embedded default job. A tiny K2.5-shaped target (K2.5 names, nesting, MLA dims,
MoE; small sizes) is pretrained for about a minute on a synthetic structured corpus
(:mod:`corpus`) so its predictions carry signal -- a random-weight target gives a draft little
to learn. Conversations are rendered with the ``kimi-k2.5`` template and tokenized with the
stand-in tokenizer (K2.5's special ids, byte-level text); aux + last hidden states are captured
with the reference hooks (:mod:`capture`, what SGLang captures) into SpecForge's offline
feature format; SpecForge's own EAGLE-3 trainer trains a Llama-style draft; the draft is
exported in SGLang's format with K2.5's ``eagle_config`` and provenance and checked. Reported:
loss curve (PNG), simulated acceptance length (:mod:`simulate`) before and after training on
held-out samples, the export path. The online path (SGLang capture -> Mooncake) replaces the
hook capture on GPUs; everything downstream of the features is the same SpecForge code.

Console (:mod:`console`): one line per stage and one progress bar for each long one (pretraining,
capture, training with its live loss), sized to its real total; plain lines when the console is not
a terminal. From the first draft on, SpecForge's own output (its per-step metric dicts, its notices)
goes to ``<out>/specforge.log`` only; the training bar reads its loss from those lines.
"""

from __future__ import annotations

import json
import platform
import shutil
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from specforge_kimi.durable import write_atomic
from specforge_kimi.errors import KimiInputError
from specforge_kimi.scratch import reset_owned_dir

#: The demo's target: K2.5's structure at CPU size (4 heads: the demo never runs tensor-parallel).
DEMO_TARGET = dict(
    layers=6,
    hidden=256,
    heads=4,
    experts=8,
    experts_per_token=2,
    moe_intermediate=128,
    dense_intermediate=512,
    q_lora_rank=256,
    vision_hidden=32,
    vision_heads=8,
)
#: SpecForge ids; SGLang 0.5.14 captures positions [2, 3, 4] (= HF hidden_states[2..4]) for them.
DEMO_AUX_IDS = (1, 2, 3)
MARKER = ".specforge-kimi-demo"
DRAFT_FAMILIES = ("eagle3", "dflash", "both")
EAGLE3_DECODE_WHAT = (
    "the target's own greedy continuation of each held-out prompt (decode_tokens new tokens), captured with the "
    "reference hooks and walked in decode rounds (simulate.serving_rounds: chain, top-k 1, eval_steps drafts), which on "
    "the target's own greedy text is what greedy chain speculation accepts; mean over all rounds; the target's argmax "
    "over the draft vocabulary, as the DFlash demo's"
)
PAIR_WHAT = (
    "mean acceptance length per decode round (drafted tokens the target accepts + its own token) of greedy "
    "speculative decoding of the same held-out prompts on the same target; each family's decode_acceptance.what "
    "says how it is counted"
)


@dataclass
class DemoSettings:
    out_dir: str = "runs/demo"
    steps: int = 300
    pretrain_seconds: float = 60.0
    pretrain_steps: int = 0  # > 0: also stop pretraining after this many steps (a target that does not
    # depend on the machine's speed, up to CPU non-determinism)
    seed: int = 0
    train_conversations: int = 400
    heldout_conversations: int = 48
    ttt_length: int = 4
    eval_steps: int = 3  # chain length for simulated acceptance: 3 steps, topk 1
    draft_vocab_size: int = 0  # 0: exactly the trained tokens + K2.5's emitted specials (see below)
    learning_rate: float = 3e-4
    progress: bool = True
    draft: str = "eagle3"  # eagle3, dflash (a DFlash block draft: demo.block_draft) or both, on one target
    block_size: int = 4  # DFlash: tokens per block (at most this many accepted per round, as EAGLE-3's 3 steps + 1)
    num_anchors: int = 32  # DFlash: SpecForge's training.num_anchors (blocks per sample; each scores the full vocab)
    decode_tokens: int = 32  # new tokens per held-out prompt in the greedy decode both drafts are measured on

    def __post_init__(self) -> None:
        if self.draft not in DRAFT_FAMILIES:
            raise KimiInputError(f"--draft {self.draft!r}: choose one of {', '.join(DRAFT_FAMILIES)}")


def _draft_config(hidden: int, draft_vocab: int, aux_ids: list[int]) -> dict:
    from specforge_kimi.demo.draft_steps import one_layer_draft

    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        **one_layer_draft(hidden),
        "rms_norm_eps": 1e-5,
        "draft_vocab_size": draft_vocab,
        "target_hidden_size": hidden,
        "torch_dtype": "bfloat16",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux_ids, "use_aux_hidden_state": True},
    }


def _load_draft(draft_config_path: str, target_dir: str, embedding_key: str, vocab_mapping: str, state=None):
    import torch
    from specforge.modeling.auto import AutoDraftModel, AutoDraftModelConfig

    cfg = AutoDraftModelConfig.from_file(draft_config_path)
    model = AutoDraftModel.from_config(cfg, attention_backend="sdpa", torch_dtype=torch.float32)
    if state is not None:
        missing, unexpected = model.load_state_dict(state, strict=False)
        if unexpected or any("embed" not in k for k in missing):
            raise RuntimeError(f"checkpoint does not fit the draft: missing={missing} unexpected={unexpected}")
    model.load_embedding(target_dir, embedding_key=embedding_key)
    model.load_vocab_mapping(vocab_mapping)
    return model.float().eval()


def _plot(losses: list[float], acc: list[list[float]], path: Path, title: str = "EAGLE-3") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(10, 3.6))
    ax[0].plot(range(1, len(losses) + 1), losses, lw=0.8)
    w = max(1, len(losses) // 20)
    smooth = [
        sum(losses[max(0, i - w + 1) : i + 1]) / len(losses[max(0, i - w + 1) : i + 1]) for i in range(len(losses))
    ]
    ax[0].plot(range(1, len(losses) + 1), smooth, lw=2)
    ax[0].set(xlabel="optimizer step", ylabel="SpecForge train/loss", title=f"{title} draft loss (tiny K2.5)")
    if acc:
        for j in range(len(acc[0])):
            ax[1].plot([a[j] for a in acc], lw=0.8, label=f"TTT position {j}")
        ax[1].set(xlabel="optimizer step", ylabel="train/acc_j", title="per-position accuracy")
        ax[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


@dataclass
class DemoInputs:
    """What the demo's steps 1-4 produce, before any draft exists (see :func:`prepare_inputs`)."""

    out: Path
    spec: Any  # TinySpec of the target
    pretrain: Any  # PretrainResult
    target_dir: Path
    info: Any  # TargetInfo (inspect_target)
    aux: Any  # AuxLayers
    feat_dir: Path  # training features (SpecForge offline format, one .ckpt per row)
    feat_dtype: Any
    held: list  # held-out samples, with target_greedy / target_p_draft cached
    train_rows: int
    held_rows: int
    draft_vocab: int
    vm_path: Path
    draft_cfg_path: Path  # the Llama-style draft config
    head_w: Any  # target lm_head weight, fp32
    since: float = 0.0  # time.monotonic() at the last ``lap`` (the demo times step 4 from there)


def demo_rows(s: DemoSettings, tokenizer=None) -> tuple[list, list, list, list]:
    """The demo's training and held-out conversations and their rendered rows (deterministic
    in ``s.seed`` / ``s.train_conversations`` / ``s.heldout_conversations``)."""
    from specforge_kimi.data import corpus
    from specforge_kimi.data.chat_template import encode_records
    from specforge_kimi.data.tokenizer import build_standin_tokenizer

    tokenizer = tokenizer or build_standin_tokenizer()
    train_recs = list(corpus.conversations(s.train_conversations, seed=s.seed))
    held_recs = list(corpus.conversations(s.heldout_conversations, seed=s.seed + 10_000))
    return train_recs, held_recs, encode_records(train_recs, tokenizer), encode_records(held_recs, tokenizer)


def capture_samples(
    model, rows, aux, feat_dtype, *, batch: int = 16, progress: bool = False, desc: str = "[3/6] capture"
):
    """Yield ``(row index, sample)`` for ``rows`` in the demo's capture order (sorted by length,
    batches of ``batch``): SpecForge offline-format samples captured with the reference hooks."""
    import torch

    from specforge_kimi.console import Progress
    from specforge_kimi.targets.capture import capture

    order = sorted(range(len(rows)), key=lambda i: len(rows[i][0]))
    bar = Progress(desc, len(rows), unit="row", enabled=progress)
    for b in range(0, len(order), batch):
        idx = order[b : b + batch]
        T = max(len(rows[i][0]) for i in idx)
        # Right padding is exact here: attention is causal, so real positions never see pads.
        ids_t = torch.full((len(idx), T), 0, dtype=torch.long)
        for k, i in enumerate(idx):
            ids_t[k, : len(rows[i][0])] = torch.tensor(rows[i][0])
        cap = capture(model, ids_t.to(next(model.parameters()).device), aux)
        for k, n in enumerate(idx):
            ids, mask = rows[n]
            L = len(ids)
            yield (
                n,
                {
                    "input_ids": torch.tensor(ids, dtype=torch.long),
                    "loss_mask": torch.tensor(mask, dtype=torch.long),
                    "hidden_state": cap.last[k : k + 1, :L].to("cpu", feat_dtype).clone(),
                    "aux_hidden_state": cap.aux[k : k + 1, :L].to("cpu", feat_dtype).clone(),
                },
            )
        bar.update(len(idx))
    bar.close()


def _pretrained_target(s: DemoSettings, out: Path, train_rows, tokenizer, say):
    """Step 2: a tiny K2.5 target pretrained briefly on the corpus rows, with the stand-in tokenizer beside it;
    returns its spec, the pretraining result and its directory."""
    from specforge_kimi.demo.pretrain import pretrain
    from specforge_kimi.targets.tiny import TinySpec, write_tiny

    spec = TinySpec(seed=s.seed, **DEMO_TARGET)
    random_dir = write_tiny(out / "target-random", spec)
    say(
        f"[2/6] pretraining the tiny K2.5 target for up to {s.pretrain_seconds:.0f}s on the synthetic corpus "
        "(a random-weight target's predictions carry little signal)"
    )
    pre = pretrain(
        str(random_dir),
        [i for i, _ in train_rows],
        str(out / "target"),
        seconds=s.pretrain_seconds,
        seed=s.seed,
        progress=s.progress,
        desc="[2/6] pretrain",
        **({"max_steps": s.pretrain_steps} if s.pretrain_steps > 0 else {}),
    )
    shutil.rmtree(random_dir)
    target_dir = out / "target"
    tokenizer.save_pretrained(target_dir)
    say(f"      target loss {pre.first_loss:.3f} -> {pre.last_loss:.3f} in {pre.steps} steps")
    return spec, pre, target_dir


def _capture_features(s: DemoSettings, target_dir: Path, aux, train_rows, held_rows, feat_dir: Path):
    """Step 3: the training rows' features written to ``feat_dir`` as SpecForge offline samples, the held-out
    rows' kept in memory; returns the feature dtype, the held-out samples and the trained-token counts."""
    import torch

    from specforge_kimi.targets.checkpoint import load_text_model

    model = load_text_model(target_dir)
    # SpecForge feeds features to the draft without a cast, so they carry the training dtype:
    # bf16 on GPUs; fp32 on a CPU, where bf16 matmuls run several times slower.
    feat_dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    feat_dir.mkdir()
    held = []
    counts: Counter = Counter()
    rows = train_rows + held_rows
    for n, sample in capture_samples(model, rows, aux, feat_dtype, progress=s.progress):
        if n < len(train_rows):
            if s.draft != "eagle3":
                # DFlash's ``hidden_states`` [1, S, N*H]: its ids capture EAGLE-3's positions, so the same tensor
                # (saved once: torch.save keeps the shared storage)
                sample["hidden_states"] = sample["aux_hidden_state"]
            torch.save(sample, feat_dir / f"sample-{n:06d}.ckpt")
            ids, mask = rows[n]
            counts.update(t_ for t_, m in zip(ids, mask, strict=False) if m)
        else:
            held.append(sample)
    return feat_dtype, held, counts


def prepare_inputs(s: DemoSettings, say=None, lap=None) -> DemoInputs:
    """The demo's steps 1-4 up to the first draft: data, pretrained tiny target, captured
    features, vocab mapping, Llama-style draft config, held-out samples with the target's greedy
    tokens and draft-vocab distribution cached. Writes under ``s.out_dir`` (must be a demo
    directory or absent). ``lap(name, since)`` records timings."""
    import torch

    import specforge_kimi
    from specforge_kimi.data.tokenizer import build_standin_tokenizer
    from specforge_kimi.data.vocab_mapping import build_vocab_mapping, save_vocab_mapping
    from specforge_kimi.evaluate.simulate import add_target_greedy
    from specforge_kimi.targets.checkpoint import inspect_target
    from specforge_kimi.targets.layer_ids import AuxLayers

    say = say or (lambda *a, **k: None)
    lap = lap or (lambda name, since: time.monotonic())
    specforge_kimi.register()
    torch.manual_seed(s.seed)
    out = Path(s.out_dir).resolve()
    reset_owned_dir(out, marker=MARKER, kind="demo", owner="specforge-kimi demo", flag="--out")

    # 1. data: K2.5 chat format, stand-in tokenizer
    t = time.monotonic()
    tokenizer = build_standin_tokenizer()
    train_recs, _, train_rows, held_rows = demo_rows(s, tokenizer)
    (out / "conversations.jsonl").write_text("".join(json.dumps(r) + "\n" for r in train_recs))
    say(
        f"[1/6] {len(train_rows)} training rows, {len(held_rows)} held-out rows rendered with the kimi-k2.5 "
        f"template ({sum(len(i) for i, _ in train_rows)} tokens, {sum(sum(m) for _, m in train_rows)} trained)"
    )
    t = lap("data", t)

    # 2. tiny target, pretrained briefly on the corpus
    spec, pre, target_dir = _pretrained_target(s, out, train_rows, tokenizer, say)
    info = inspect_target(target_dir)
    t = lap("pretrain", t)

    # 3. capture aux + last hidden states with the reference hooks -> SpecForge offline features
    aux = AuxLayers.from_specforge(DEMO_AUX_IDS, info.num_layers)
    if s.draft != "eagle3":
        from specforge_kimi.demo.block_draft import DEMO_DFLASH_IDS

        if AuxLayers.from_dflash(DEMO_DFLASH_IDS, info.num_layers).positions != aux.positions:
            raise RuntimeError(f"DFlash ids {DEMO_DFLASH_IDS} capture other layers than EAGLE-3's {DEMO_AUX_IDS}")
    feat_dir = out / "features"
    feat_dtype, held, counts = _capture_features(s, target_dir, aux, train_rows, held_rows, feat_dir)
    since = lap("capture", t)

    # 4. vocab mapping + draft config
    # The corpus uses ~100 distinct tokens; padding a draft vocab with tokens the target never
    # emits (zeroed head rows -> logit 0) would flatten the teacher distribution over it.
    from specforge_kimi.data.vocab_mapping import emitted_special_ids

    draft_vocab = s.draft_vocab_size or len(set(counts) | set(emitted_special_ids()))
    mapping = build_vocab_mapping(
        counts, draft_vocab_size=draft_vocab, target_vocab_size=info.vocab_size, source={"demo": str(out)}
    )
    vm_path = save_vocab_mapping(mapping, out / "vocab_mapping.pt")
    draft_cfg_path = out / "draft_config.json"
    draft_cfg_path.write_text(json.dumps(_draft_config(info.hidden_size, draft_vocab, aux.specforge_ids()), indent=2))
    head_w = load_head_weight(target_dir, info)
    add_target_greedy(held, head_w, t2d=mapping.t2d)
    return DemoInputs(
        out=out,
        spec=spec,
        pretrain=pre,
        target_dir=target_dir,
        info=info,
        aux=aux,
        feat_dir=feat_dir,
        feat_dtype=feat_dtype,
        held=held,
        train_rows=len(train_rows),
        held_rows=len(held_rows),
        draft_vocab=draft_vocab,
        vm_path=Path(vm_path),
        draft_cfg_path=draft_cfg_path,
        head_w=head_w,
        since=since,
    )


def load_head_weight(target_dir, info):
    """The target's lm_head weight (fp32)."""
    from safetensors import safe_open

    from specforge_kimi.targets.checkpoint import weight_index

    with safe_open(str(Path(target_dir) / weight_index(target_dir)[info.lm_head_key]), framework="pt") as f:
        return f.get_tensor(info.lm_head_key).float()


def run_demo(s: DemoSettings) -> dict:
    """Run the demo; returns (and writes ``demo_result.json``) the measured results."""
    from specforge_kimi import console

    console.quiet_known_notices()
    t0 = time.monotonic()
    timings: dict[str, float] = {}
    say = console.say if s.progress else (lambda *a, **k: None)

    def lap(name: str, since: float) -> float:
        timings[name] = round(time.monotonic() - since, 2)
        return time.monotonic()

    inp = prepare_inputs(s, say, lap)
    log = inp.out / "specforge.log"
    # from the first draft on, SpecForge's own output (metric dicts, notices, bars) goes to the log only
    from specforge_kimi.run.progress import StepLines

    steps = StepLines()  # the training bar follows SpecForge's own step lines
    with console.output_to_log(log, on_line=steps):
        if s.draft != "both":
            return _one_draft(s, s.draft, inp, say, lap, timings, t0, log, steps, "demo_result.json")
        results = {}
        for family in ("eagle3", "dflash"):
            results[family] = _one_draft(
                s, family, inp, say, lap, dict(timings), t0, log, steps, f"demo_result_{family}.json"
            )
    return _pair(inp.out, results, say)


def _one_draft(s: DemoSettings, family: str, inp: DemoInputs, say, lap, timings, t0, log, steps, name: str) -> dict:
    """One draft family's steps 4-6 on the prepared inputs; its summary written to ``<out>/name``."""
    if family == "dflash":
        from specforge_kimi.demo import block_draft

        summary = block_draft.train_evaluate_export(s, inp, say, lap, timings, t0, log, steps, base_summary)
        _plot(summary["train"]["losses"], [], inp.out / "loss_curve_dflash.png", "DFlash")
    else:
        summary = _train_evaluate_export(s, inp, say, lap, timings, t0, log, steps)
    write_atomic(inp.out / name, json.dumps(summary, indent=2))
    dec = summary["decode_acceptance"]
    say(
        f"        {family}: acceptance length on the held-out prompts' greedy decode "
        f"{dec['before']['mean_acceptance_length']:.3f} -> {dec['after']['mean_acceptance_length']:.3f} "
        f"(at most {dec['after']['max_per_round']} per round); {inp.out / name}"
    )
    return summary


def _pair(out: Path, results: dict, say) -> dict:
    """``demo --draft both``: the two summaries side by side in ``<out>/demo_result.json``."""
    pair = {
        f: {
            "acceptance_before": r["decode_acceptance"]["before"]["mean_acceptance_length"],
            "acceptance_after": r["decode_acceptance"]["after"]["mean_acceptance_length"],
            "max_per_round": r["decode_acceptance"]["after"]["max_per_round"],
            "rounds": r["decode_acceptance"]["after"]["rounds"],
            "export_dir": r["export_dir"],
        }
        for f, r in results.items()
    }
    e, d = pair["eagle3"]["acceptance_after"], pair["dflash"]["acceptance_after"]
    summary = {
        "ok": all(r["ok"] for r in results.values()),
        "draft_family": "both",
        "pair": {**pair, "dflash_over_eagle3": d / e, "what": PAIR_WHAT},
        **results,
    }
    write_atomic(out / "demo_result.json", json.dumps(summary, indent=2))
    say(f"pair (same target, same {results['dflash']['decode_acceptance']['after']['prompts']} held-out prompts):")
    for f, p in pair.items():
        say(f"        {f:7s} acceptance length {p['acceptance_before']:.3f} -> {p['acceptance_after']:.3f}")
    say(f"        DFlash / EAGLE-3 after training: {d / e:.2f}x; {out / 'demo_result.json'}")
    return summary


def _specforge_train(s: DemoSettings, inp: DemoInputs, say, log: Path, steps) -> dict:
    """Step 5: SpecForge's own EAGLE-3 training on the captured features, its steps shown on ``steps.bar``."""
    from specforge_kimi.demo.draft_steps import train_draft

    return train_draft(
        s,
        inp,
        say,
        log,
        steps,
        family="EAGLE-3",
        detail=f"TTT length {s.ttt_length}",
        draft_config_path=inp.draft_cfg_path,
        vocab_mapping_path=str(inp.vm_path),
        output_dir=inp.out / "train",
    )


def base_summary(s: DemoSettings, inp: DemoInputs, result: dict, losses_gain, export_dir, family: str) -> dict:
    """``demo_result.json``'s keys every draft family writes: settings, target, training, export."""
    import torch

    from specforge_kimi.provenance import versions

    out, spec, pre, target_dir, aux = inp.out, inp.spec, inp.pretrain, inp.target_dir, inp.aux
    losses = result["losses"]
    first, last, _ = losses_gain
    return {
        "draft_family": family,
        "command": sys.argv,
        "environment": {
            "platform": platform.platform(),
            "cpu_count": __import__("os").cpu_count(),
            "cuda": torch.cuda.is_available(),
            "versions": versions(),
        },
        "settings": asdict(s),
        "target": {
            "dir": str(target_dir),
            "spec": asdict(spec),
            "pretrain_steps": pre.steps,
            "pretrain_loss_first": pre.first_loss,
            "pretrain_loss_last": pre.last_loss,
            "aux_specforge_ids": list(DEMO_AUX_IDS),
            "captured_positions": list(aux.positions),
        },
        "train": {
            "steps": len(losses),
            "loss_first_mean": first,
            "loss_last_mean": last,
            "losses": losses,
            "acc_per_position_last": (result.get("acc_per_position") or [[]])[-1],
            "checkpoint_dir": result["checkpoint_dir"],
        },
        "export_dir": str(export_dir),
        "loss_curve_png": str(out / ("loss_curve.png" if family == "eagle3" else f"loss_curve_{family}.png")),
    }


def _demo_summary(s: DemoSettings, inp: DemoInputs, result: dict, before, after, losses_gain, export_dir) -> dict:
    """``demo_result.json``: settings, target, training, simulated acceptance and held-out loss before and after."""
    gain = losses_gain[2]
    return {
        **base_summary(s, inp, result, losses_gain, export_dir, "eagle3"),
        "ok": bool(after.heldout_loss < before.heldout_loss and gain > 0),
        "simulated_acceptance": {
            "steps": s.eval_steps,
            "topk": 1,
            "heldout_chains": after.chains,
            "before": before.mean_acceptance_length,
            "after": after.mean_acceptance_length,
            "gain": gain,
            "per_step_before": before.per_step_accuracy,
            "per_step_after": after.per_step_accuracy,
            "decode_rounds": {
                "before": before.serving_acceptance_length,
                "after": after.serving_acceptance_length,
                "at_least_after": after.serving_at_least,
                "rounds": after.serving_rounds,
                "what": "acceptance over decode rounds as the engine takes them (simulate.serving_rounds); "
                "on corpus answers, not the target's own greedy text, so still an estimate",
            },
        },
        "heldout_loss": {
            "before": before.heldout_loss,
            "after": after.heldout_loss,
            "teacher_entropy": after.teacher_entropy,
            "kl_before": before.heldout_loss - before.teacher_entropy,
            "kl_after": after.heldout_loss - after.teacher_entropy,
            "what": "SpecForge per-position loss -sum(target_p log q) on held-out samples, mean over "
            "TTT steps; deterministic, unlike the per-sample training loss",
        },
    }


def _train_evaluate_export(
    s: DemoSettings, inp: DemoInputs, say, lap, timings: dict, t0: float, log: Path, steps
) -> dict:
    """The demo's steps 4-6: the untrained draft, SpecForge's training, evaluation, export and the summary."""
    import torch

    from specforge_kimi.demo.draft_steps import loss_means
    from specforge_kimi.drafts.export import export_run_draft
    from specforge_kimi.evaluate.simulate import simulated_acceptance

    out, target_dir, info, aux, held, head_w = inp.out, inp.target_dir, inp.info, inp.aux, inp.held, inp.head_w
    vm_path, draft_cfg_path = inp.vm_path, inp.draft_cfg_path
    t = inp.since
    torch.manual_seed(s.seed)
    untrained = _load_draft(str(draft_cfg_path), str(target_dir), info.embedding_key, str(vm_path))
    before = simulated_acceptance(untrained, head_w, held, s.eval_steps)
    say(
        f"[4/6] untrained draft: simulated acceptance length {before.mean_acceptance_length:.3f} "
        f"({s.eval_steps} steps, topk 1, {before.chains} held-out chains)"
    )
    t = lap("eval_before", t)

    # 5. SpecForge's own EAGLE-3 training
    result = _specforge_train(s, inp, say, log, steps)
    losses = result["losses"]
    t = lap("train", t)
    from specforge.export.checkpoint_io import resolve_training_state

    state = resolve_training_state(result["checkpoint_dir"])["draft_state_dict"]
    trained = _load_draft(str(draft_cfg_path), str(target_dir), info.embedding_key, str(vm_path), state=state)
    after = simulated_acceptance(trained, head_w, held, s.eval_steps)
    from specforge_kimi.demo.block_draft import decode_samples, eagle3_decode_acceptance

    decoded = decode_samples(
        inp, s.decode_tokens, capture_samples
    )  # the held-out prompts' greedy decode, as the DFlash demo's
    decode = {
        "before": eagle3_decode_acceptance(untrained, inp, decoded, s.eval_steps),
        "after": eagle3_decode_acceptance(trained, inp, decoded, s.eval_steps),
    }
    t = lap("eval_after", t)

    # 6. export for SGLang, K2.5 eagle_config + provenance, checks
    export_dir = out / "export-sglang"
    export_run_draft(
        result["checkpoint_dir"],
        draft_cfg_path,
        export_dir,
        vocab_mapping_path=str(vm_path),
        target_dir=target_dir,
        aux=aux,
        command=sys.argv,
        extra={"demo": {"steps": s.steps, "seed": s.seed}},
    )
    t = lap("export", t)

    k, first, last = loss_means(losses)
    gain = after.mean_acceptance_length - before.mean_acceptance_length
    _plot(losses, result.get("acc_per_position") or [], out / "loss_curve.png")
    summary = _demo_summary(s, inp, result, before, after, (first, last, gain), export_dir)
    summary["decode_acceptance"] = {
        **decode,
        "gain": decode["after"]["mean_acceptance_length"] - decode["before"]["mean_acceptance_length"],
        "what": EAGLE3_DECODE_WHAT,
    }
    summary["timings_s"] = {**timings, "total": round(time.monotonic() - t0, 2)}
    say(f"[6/6] exported SGLang draft: {export_dir}")
    say(
        f"result: held-out loss {before.heldout_loss:.3f} -> {after.heldout_loss:.3f}, training loss {first:.3f} -> "
        f"{last:.3f} (mean of the first/last {k} steps)"
    )
    say(
        f"        simulated acceptance length {before.mean_acceptance_length:.3f} -> "
        f"{after.mean_acceptance_length:.3f} (+{gain:.3f}); over decode rounds "
        f"{before.serving_acceptance_length:.3f} -> {after.serving_acceptance_length:.3f}"
    )
    say(f"        {out / 'loss_curve.png'}; SpecForge's log {log}; {summary['timings_s']['total']:.0f}s")
    return summary
