"""Tiny-target comparison of an MLA and a Llama-style EAGLE-3 draft trained on the same data (CPU).

Issue 5: until the engine bench can run, compare the two draft architectures by simulated
acceptance length on the demo's pretrained tiny K2.5 target. Both drafts are trained by
SpecForge 0.2.0's own trainer, in this process, as the demo trains its draft
(:func:`specforge_kimi.demo.draft_steps.train_draft`; SpecForge's output in ``<work>/train-<draft>.log``),
on the SAME captured features with the same steps, seed, learning rate, TTT length and vocab
mapping:

- ``llama``: the demo's draft config (``LlamaForCausalLMEagle3``, 1 layer, GQA 4 heads x 64,
  MLP 4 x hidden, plain rope theta 1e4);
- ``mla``: :func:`specforge_kimi.drafts.mla_eagle3.tiny_config` for the same target (MLA with
  the target's q_lora rank and K2.5's kv_lora / head dims, the target's YaRN rope, dense MLP of
  the target's dense width), ``draft_vocab_size`` from the same vocab mapping
  (:func:`~specforge_kimi.drafts.mla_eagle3.with_vocab_mapping`), aux ids = the demo's.

Each draft is evaluated before training (random init after ``torch.manual_seed(seed)``, as the
demo does) and after, on the same held-out samples, with :func:`specforge_kimi.evaluate.simulate.
simulated_acceptance` (chain, top-k 1, greedy verification; default 3 steps) and SpecForge's
held-out loss (``-sum target_p log q`` over the draft vocab, mean over the simulated steps and
trained positions). Results: ``bench/results/mla_vs_llama_cpu.json``.

Target and features, either
- built here exactly as ``specforge-kimi demo`` builds them (:func:`specforge_kimi.demo.pipeline.
  prepare_inputs`, under ``<work>/demo``; pretraining is time-bounded, so each build differs), or
- reused from a finished demo directory (``--demo-dir runs/demo``): its ``target/``,
  ``features/``, ``vocab_mapping.pt``, ``draft_config.json`` and the settings in
  ``demo_result.json``. The demo keeps the held-out samples in memory only, so they are
  re-captured here with the demo's own capture (:func:`specforge_kimi.demo.pipeline.capture_samples`, same
  rows, same batches); the training rows are captured alongside and compared with the feature
  files on disk, which proves the re-capture reproduces the demo's.

Usage::

    python bench/studies/mla_vs_llama.py --demo-dir runs/demo            # reuse the demo's target/features
    python bench/studies/mla_vs_llama.py --steps 300                      # build a fresh demo target first

Scope: simulated acceptance with teacher-forced data tokens (see :mod:`specforge_kimi.evaluate.simulate`),
a tiny target on a synthetic corpus, fp32 on the CPU. It says which draft fits this target's
features better at equal data and steps; it is no engine measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "bench" / "results" / "mla_vs_llama_cpu.json"
MARKER = ".specforge-kimi-bench"


def _prepare_work(work: Path) -> None:
    from specforge_kimi.errors import KimiInputError
    from specforge_kimi.scratch import reset_owned_dir

    try:
        reset_owned_dir(work, marker=MARKER, kind="bench", owner="bench/studies/mla_vs_llama.py", flag="--work")
    except KimiInputError as exc:
        raise SystemExit(f"error: {exc}") from None


def inputs_from_demo_dir(demo_dir: Path, progress: bool):
    """Target, features, vocab mapping and Llama draft config of a finished demo run; held-out
    samples re-captured with the demo's capture and checked through the training rows."""
    import torch

    import specforge_kimi
    from specforge_kimi.data.vocab_mapping import load_vocab_mapping
    from specforge_kimi.demo.pipeline import (
        DEMO_AUX_IDS,
        DemoInputs,
        DemoSettings,
        capture_samples,
        demo_rows,
        load_head_weight,
    )
    from specforge_kimi.evaluate.simulate import add_target_greedy
    from specforge_kimi.targets.checkpoint import inspect_target, load_text_model
    from specforge_kimi.targets.layer_ids import AuxLayers
    from specforge_kimi.targets.tiny import TinySpec

    specforge_kimi.register()
    demo_dir = demo_dir.resolve()
    result_path = demo_dir / "demo_result.json"
    for need in ("target", "features", "vocab_mapping.pt", "draft_config.json", "demo_result.json"):
        if not (demo_dir / need).exists():
            raise SystemExit(f"{demo_dir} lacks {need}: not a finished `specforge-kimi demo` output")
    demo = json.loads(result_path.read_text())
    fields = DemoSettings.__dataclass_fields__
    s = DemoSettings(**{k: v for k, v in demo["settings"].items() if k in fields})
    if list(demo["target"]["aux_specforge_ids"]) != list(DEMO_AUX_IDS):
        raise SystemExit(f"demo used aux ids {demo['target']['aux_specforge_ids']}, this code {DEMO_AUX_IDS}")
    spec = TinySpec(**demo["target"]["spec"])
    target_dir = demo_dir / "target"
    info = inspect_target(target_dir)
    aux = AuxLayers.from_specforge(DEMO_AUX_IDS, info.num_layers)
    feat_dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    _, _, train_rows, held_rows = demo_rows(s)
    feat_dir = demo_dir / "features"
    n_files = len(list(feat_dir.glob("sample-*.ckpt")))
    if n_files != len(train_rows):
        raise SystemExit(f"{feat_dir} holds {n_files} samples, the demo settings give {len(train_rows)} rows")
    model = load_text_model(target_dir)
    rows = train_rows + held_rows
    held, equal, max_diff = [], 0, 0.0
    for n, sample in capture_samples(model, rows, aux, feat_dtype, progress=progress, desc="re-capture"):
        if n < len(train_rows):
            disk = torch.load(feat_dir / f"sample-{n:06d}.ckpt", weights_only=True)
            same = all(torch.equal(disk[k], sample[k]) for k in ("input_ids", "loss_mask"))
            if not same:
                raise SystemExit(f"row {n}: tokens differ from {feat_dir}/sample-{n:06d}.ckpt (other corpus?)")
            d = max(
                float((disk[k].float() - sample[k].float()).abs().max()) for k in ("hidden_state", "aux_hidden_state")
            )
            max_diff = max(max_diff, d)
            equal += int(d == 0.0)
        else:
            held.append(sample)
    del model
    mapping = load_vocab_mapping(demo_dir / "vocab_mapping.pt")
    head_w = load_head_weight(target_dir, info)
    add_target_greedy(held, head_w, t2d=mapping.t2d)

    class Pre:  # what the summary reads from a PretrainResult
        steps = demo["target"]["pretrain_steps"]
        first_loss = demo["target"]["pretrain_loss_first"]
        last_loss = demo["target"]["pretrain_loss_last"]

    inp = DemoInputs(
        out=demo_dir,
        spec=spec,
        pretrain=Pre,
        target_dir=target_dir,
        info=info,
        aux=aux,
        feat_dir=feat_dir,
        feat_dtype=feat_dtype,
        held=held,
        train_rows=len(train_rows),
        held_rows=len(held_rows),
        draft_vocab=int(mapping.t2d.sum()),
        vm_path=demo_dir / "vocab_mapping.pt",
        draft_cfg_path=demo_dir / "draft_config.json",
        head_w=head_w,
    )
    check = {
        "train_rows_recaptured": len(train_rows),
        "bit_identical_to_feature_files": equal,
        "max_abs_diff": max_diff,
    }
    return s, inp, check


def _rel(path: str) -> str:
    try:
        return str(Path(path).relative_to(Path.cwd()))
    except ValueError:
        return path


def param_counts(model) -> dict:
    """Trainable parameters (everything but the frozen target embedding), total and by module."""
    groups: dict[str, int] = {}
    total = 0
    for name, p in model.named_parameters():
        if "embed_tokens" in name:
            continue
        total += p.numel()
        parts = name.split(".")
        key = ".".join(parts[:2]) if parts[0] == "midlayer" else parts[0]
        groups[key] = groups.get(key, 0) + p.numel()
    return {
        "trainable": total,
        "by_module": groups,
        "frozen_embedding": sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" in n),
    }


def _acc(r) -> dict:
    return {
        "mean_acceptance_length": r.mean_acceptance_length,
        "per_step_accuracy": r.per_step_accuracy,
        "chains": r.chains,
        "heldout_loss": r.heldout_loss,
        "teacher_entropy": r.teacher_entropy,
        "kl": r.heldout_loss - r.teacher_entropy,
    }


def run_draft(name: str, cfg_path: Path, inp, a, work: Path, say) -> dict:
    """One draft evaluated untrained, trained as the demo trains its draft (:func:`specforge_kimi.demo.draft_steps.
    train_draft`: SpecForge's output in ``<work>/train-<name>.log``, its steps on a bar) and evaluated again."""
    import torch
    from specforge.export.checkpoint_io import resolve_training_state

    from specforge_kimi import console
    from specforge_kimi.demo.draft_steps import loss_means, train_draft
    from specforge_kimi.demo.pipeline import _load_draft
    from specforge_kimi.evaluate.simulate import simulated_acceptance
    from specforge_kimi.run.progress import StepLines

    times = {}
    t = time.monotonic()
    torch.manual_seed(a.seed)
    untrained = _load_draft(str(cfg_path), str(inp.target_dir), inp.info.embedding_key, str(inp.vm_path))
    params = param_counts(untrained)
    before = simulated_acceptance(untrained, inp.head_w, inp.held, a.eval_steps)
    del untrained
    times["eval_before"] = round(time.monotonic() - t, 2)
    say(
        f"[{name}] untrained: AL {before.mean_acceptance_length:.3f}, held-out loss {before.heldout_loss:.3f}; "
        f"{params['trainable']:,} trainable parameters"
    )

    t = time.monotonic()
    log, steps = work / f"train-{name}.log", StepLines()
    with console.output_to_log(log, on_line=steps):
        result = train_draft(
            a,
            inp,
            say,
            log,
            steps,
            family="EAGLE-3",
            detail=f"TTT length {a.ttt_length}",
            draft_config_path=cfg_path,
            vocab_mapping_path=str(inp.vm_path),
            output_dir=work / f"train-{name}",
            stage=f"[{name}]",
        )
    times["train"] = round(time.monotonic() - t, 2)

    t = time.monotonic()
    state = resolve_training_state(result["checkpoint_dir"])["draft_state_dict"]
    trained = _load_draft(str(cfg_path), str(inp.target_dir), inp.info.embedding_key, str(inp.vm_path), state=state)
    after = simulated_acceptance(trained, inp.head_w, inp.held, a.eval_steps)
    times["eval_after"] = round(time.monotonic() - t, 2)

    losses = result["losses"]
    k, first, last = loss_means(losses)
    say(
        f"[{name}] trained: AL {after.mean_acceptance_length:.3f}, held-out loss {after.heldout_loss:.3f}, "
        f"training loss {first:.3f} -> {last:.3f}, {times['train']:.0f}s"
    )
    return {
        "draft_config": json.loads(Path(cfg_path).read_text()),
        "draft_config_path": str(cfg_path),
        "parameters": params,
        "before": _acc(before),
        "after": _acc(after),
        "gain": after.mean_acceptance_length - before.mean_acceptance_length,
        "train": {
            "steps": len(losses),
            "final_step": result["final_step"],
            "mean_window": k,
            "loss_first_mean": first,
            "loss_last_mean": last,
            "loss_first": losses[0],
            "loss_last": losses[-1],
            "acc_per_position_last_mean": [
                sum(r[j] for r in result["acc_per_position"][-k:]) / k
                for j in range(len(result["acc_per_position"][0]))
            ]
            if result["acc_per_position"]
            else [],
            "losses": losses,
            "checkpoint_dir": result["checkpoint_dir"],
            "seconds_per_step": times["train"] / max(1, len(losses)),
        },
        "timings_s": times,
    }


def _parser() -> argparse.ArgumentParser:
    from specforge_kimi.demo.pipeline import DemoSettings

    d = DemoSettings()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--demo-dir", default=None, help="reuse a finished `specforge-kimi demo` output (e.g. runs/demo)")
    p.add_argument("--work", default="runs/mla-vs-llama", help="scratch: training runs, MLA config, fresh demo")
    p.add_argument("--out", default=str(RESULTS), help="results JSON")
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--learning-rate", type=float, default=d.learning_rate)
    p.add_argument("--ttt-length", type=int, default=d.ttt_length)
    p.add_argument("--eval-steps", type=int, default=d.eval_steps)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--drafts", default="llama,mla", help="comma list, order of training")
    g = p.add_argument_group("fresh target (without --demo-dir), the demo's settings")
    g.add_argument("--pretrain-seconds", type=float, default=d.pretrain_seconds)
    g.add_argument("--train-conversations", type=int, default=d.train_conversations)
    g.add_argument("--heldout-conversations", type=int, default=d.heldout_conversations)
    p.add_argument("--no-progress", action="store_true")
    return p


@dataclass(frozen=True)
class Settings:
    """The flags, as ``run_draft`` and the result read them."""

    demo_dir: str | None
    work: str
    out: str
    steps: int
    learning_rate: float
    ttt_length: int
    eval_steps: int
    seed: int
    drafts: str
    pretrain_seconds: float
    train_conversations: int
    heldout_conversations: int
    no_progress: bool

    @property
    def progress(self) -> bool:
        """Whether to show progress (``train_draft`` reads it as the demo's settings)."""
        return not self.no_progress


def parse(argv=None) -> Settings:
    return Settings(**vars(_parser().parse_args(argv)))


@dataclass
class Measured:
    """What ``measure`` ran: the target's inputs and where they came from, and each draft's result."""

    demo_settings: object
    inp: object
    source: dict
    prep_s: float
    drafts: dict


def _inputs(a: Settings, work: Path, say):
    """The target and its features: reused from ``--demo-dir`` or built as the demo builds them."""
    from specforge_kimi.demo.pipeline import DemoSettings, prepare_inputs

    if a.demo_dir:
        demo_settings, inp, recapture = inputs_from_demo_dir(Path(a.demo_dir), progress=not a.no_progress)
        source = {"kind": "demo_dir", "dir": str(inp.out), "recapture_check": recapture}
        if recapture["bit_identical_to_feature_files"] != recapture["train_rows_recaptured"]:
            say(f"note: re-capture differs from the feature files by up to {recapture['max_abs_diff']:.2e}")
        return demo_settings, inp, source
    demo_settings = DemoSettings(
        out_dir=str(work / "demo"),
        seed=a.seed,
        pretrain_seconds=a.pretrain_seconds,
        train_conversations=a.train_conversations,
        heldout_conversations=a.heldout_conversations,
        progress=not a.no_progress,
    )
    inp = prepare_inputs(demo_settings, say)
    return demo_settings, inp, {"kind": "built", "dir": str(inp.out)}


def measure(a: Settings, say) -> Measured:
    """The target's inputs, then each draft of ``--drafts`` trained and evaluated on them."""
    import specforge_kimi
    from specforge_kimi.demo.pipeline import DEMO_AUX_IDS
    from specforge_kimi.drafts.mla_eagle3 import tiny_config, with_vocab_mapping, write_config

    specforge_kimi.register()
    work = Path(a.work).resolve()
    _prepare_work(work)
    t = time.monotonic()
    demo_settings, inp, source = _inputs(a, work, say)
    prep_s = round(time.monotonic() - t, 2)
    say(
        f"target {inp.target_dir}: {inp.train_rows} training rows, {len(inp.held)} held-out samples, "
        f"draft vocab {inp.draft_vocab} ({prep_s:.0f}s)"
    )

    mla_cfg = with_vocab_mapping(tiny_config(inp.spec, aux_ids=list(DEMO_AUX_IDS)), inp.vm_path)
    mla_cfg_path = Path(write_config(mla_cfg, work / "mla_draft_config.json"))
    llama_cfg = json.loads(inp.draft_cfg_path.read_text())
    if llama_cfg["draft_vocab_size"] != mla_cfg["draft_vocab_size"]:
        raise SystemExit("the two draft configs disagree on the draft vocab")
    cfgs = {"llama": inp.draft_cfg_path, "mla": mla_cfg_path}
    drafts = {}
    for name in a.drafts.split(","):
        drafts[name] = run_draft(name, cfgs[name], inp, a, work, say)
    return Measured(demo_settings=demo_settings, inp=inp, source=source, prep_s=prep_s, drafts=drafts)


WHAT = {
    "mean_acceptance_length": "simulate.simulated_acceptance: 1 + accepted draft tokens per chain, "
    "chain drafting top-k 1, greedy verification, teacher-forced data tokens",
    "per_step_accuracy": "P(step j correct | steps < j correct)",
    "heldout_loss": "SpecForge's per-position loss -sum(target_p log q) over the draft vocab, mean "
    "over the simulated steps and trained held-out positions; kl = loss - teacher "
    "entropy",
    "train.loss_*_mean": "SpecForge train/loss (sum_i 0.8**i ploss_i), mean of the first/last "
    "mean_window optimizer steps",
    "parameters.trainable": "all draft parameters but the frozen target embedding",
}


def write(a: Settings, m: Measured, t0: float) -> dict:
    """The result at ``--out``: the command, the environment, the settings, the target and each draft."""
    import torch

    from specforge_kimi.demo.pipeline import DEMO_AUX_IDS
    from specforge_kimi.provenance import git_commit, versions

    inp, drafts = m.inp, m.drafts
    summary = {
        "benchmark": "MLA vs Llama-style EAGLE-3 draft on the demo's tiny K2.5 target: simulated acceptance",
        "command": [_rel(sys.executable), *sys.argv],
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "environment": {
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "cuda": torch.cuda.is_available(),
            "git": git_commit(),
            "versions": versions(),
        },
        "settings": {
            "steps": a.steps,
            "learning_rate": a.learning_rate,
            "ttt_length": a.ttt_length,
            "seed": a.seed,
            "batch_size": 1,
            "max_length": 2048,
            "dtype": str(inp.feat_dtype).replace("torch.", ""),
            "eval": {"steps": a.eval_steps, "topk": 1, "heldout_samples": len(inp.held)},
            "draft_vocab_size": inp.draft_vocab,
            "aux_specforge_ids": list(DEMO_AUX_IDS),
            "captured_positions": list(inp.aux.positions),
        },
        "target": {
            "source": m.source,
            "dir": str(inp.target_dir),
            "spec": asdict(inp.spec),
            "demo_settings": asdict(m.demo_settings),
            "pretrain_steps": inp.pretrain.steps,
            "pretrain_loss_first": inp.pretrain.first_loss,
            "pretrain_loss_last": inp.pretrain.last_loss,
            "training_rows": inp.train_rows,
            "feature_dir": str(inp.feat_dir),
        },
        "drafts": drafts,
        "timings_s": {
            "prepare": m.prep_s,
            **{f"{n}_{k}": v for n, r in drafts.items() for k, v in r["timings_s"].items()},
            "total": round(time.monotonic() - t0, 2),
        },
        "what": WHAT,
    }
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def print_summary(a: Settings, m: Measured, summary: dict) -> None:
    parts = []
    for n, r in m.drafts.items():
        parts.append(
            f"{n}: AL {r['before']['mean_acceptance_length']:.3f} -> {r['after']['mean_acceptance_length']:.3f}"
            f", held-out loss {r['before']['heldout_loss']:.3f} -> {r['after']['heldout_loss']:.3f}"
            f", train loss {r['train']['loss_first_mean']:.3f} -> {r['train']['loss_last_mean']:.3f}"
            f", {r['parameters']['trainable'] / 1e6:.2f}M params"
        )
    print(
        f"{a.steps} steps, lr {a.learning_rate:g}, TTT {a.ttt_length}, {len(m.inp.held)} held-out samples "
        f"({m.drafts[next(iter(m.drafts))]['after']['chains']} chains): "
        + "; ".join(parts)
        + f"; {summary['timings_s']['total']:.0f}s -> {Path(a.out)}"
    )


def main(argv=None) -> int:
    a = parse(argv)
    t0 = time.monotonic()
    from specforge_kimi import console

    # console.say: the lines reach the console also while SpecForge's output goes to a draft's training log
    say = (lambda *x, **k: None) if a.no_progress else console.say
    m = measure(a, say)
    summary = write(a, m, t0)
    print_summary(a, m, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
