"""Brief pretraining of a tiny K2.5 target so that its predictions carry structure.

Scope: tiny, unquantized checkpoints on CPU or one GPU. Trains transformers'
``DeepseekV3ForCausalLM`` (loaded by :func:`target.load_text_model`) on token sequences with a
next-token loss computed from the LM-head rows of the tokens the corpus uses only (a dense
163,840-row head product would dominate CPU time); LM-head rows of tokens the corpus never uses are
zeroed afterwards, so those tokens score exactly 0. With ``loss="full"`` (the default) the training
loss already counts them as they will be -- one softmax term ``log(V - n_used)`` for the ``V - n_used``
zero logits -- so it is the written checkpoint's exact full-vocabulary cross-entropy, and a trained
token wins the argmax only by scoring above the untrained mass, as a real LM's tokens do. With
``loss="corpus"`` (the earlier behaviour) the softmax is restricted to the corpus's tokens; their
logits then float freely around 0, and after zeroing the untrained tokens often win the full-vocab
argmax and carry most of the probability (the full-vocab held-out loss stays far above the restricted
one), which also floods an EAGLE-3 draft vocabulary's filler slots. The result is written back in K2.5's
on-disk naming (:func:`tiny.write_tiny` with ``state=``). :func:`pretrain_structured_target` is
``specforge-kimi tiny --pretrain``: corpus -> pretraining -> stand-in tokenizer + ``pretrain.json``.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from specforge_kimi.durable import write_atomic
from specforge_kimi.errors import KimiInputError


@dataclass
class PretrainResult:
    steps: int
    seconds: float
    first_loss: float
    last_loss: float
    losses: list[float]
    schedule_fraction: float = 1.0  # how far the lr schedule got (1.0: to its end)


def cosine_scale(frac: float, warmup: float = 0.03, floor: float = 0.05) -> float:
    """Learning-rate multiplier at ``frac`` (0..1) of the budget: linear warm-up, cosine to ``floor``."""
    frac = min(1.0, max(0.0, frac))
    if frac < warmup:
        return frac / warmup
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * (frac - warmup) / (1 - warmup)))


def pretrain(
    model_dir: str,
    sequences: Sequence[Sequence[int]],
    out_dir: str,
    *,
    seconds: float = 60.0,
    max_steps: int = 10_000,
    batch_size: int = 8,
    lr: float = 2e-3,
    seed: int = 0,
    progress: bool = True,
    device: str = "cpu",
    schedule: str = "constant",
    loss: str = "full",
    deterministic: bool = True,
    precision: str = "fp32",
    desc: str = "pretrain tiny target",
) -> PretrainResult:
    """Train ``model_dir``'s text model on ``sequences`` for at most ``seconds``; write ``out_dir``.
    ``progress``: one bar labelled ``desc`` (:class:`console.Progress`), sized to the steps the budget allows.

    ``deterministic``: run under ``torch.use_deterministic_algorithms(True)`` (cuBLAS workspace
    pinned), so that a step-bounded run repeats bit for bit on the same device and software. Without
    it two runs part from the second step (bench/REPORT.md, "Tiny target repeatability":
    ``bench/studies/pretrain_repro.py``); warn-only mode names the CUDA backward of memory-efficient attention
    as the non-deterministic kernel. On the CPU, a few steps leave the weights apart without it and identical
    with it.

    ``schedule``: ``constant`` (``lr`` throughout) or ``cosine`` (linear warm-up over the first 3%,
    then cosine decay to 5% of ``lr``). Deterministic runs follow the step count (``step /
    max_steps``) only: nothing read from the clock may change the weights, so a time budget that
    ends first cuts the schedule short (``PretrainResult.schedule_fraction`` says where); a schedule that also
    followed the clock parted two otherwise identical runs at step 1 (bench/REPORT.md, "Tiny target
    repeatability").
    Non-deterministic runs follow time or steps, whichever runs out first.

    ``loss``: ``full`` or ``corpus`` (module docstring).

    ``precision``: ``fp32`` (every product in float32) or ``bf16`` (the decoder's forward under bf16
    autocast, weights, optimizer state and the loss in float32 -- the usual mixed precision; the
    checkpoint is written in bf16 and served in bf16 either way)."""
    if schedule not in ("constant", "cosine"):
        raise KimiInputError(f"pretraining schedule must be constant or cosine, not {schedule!r}")
    if loss not in ("full", "corpus"):
        raise KimiInputError(f"pretraining loss must be full or corpus, not {loss!r}")
    if precision not in ("fp32", "bf16"):
        raise KimiInputError(f"pretraining precision must be fp32 or bf16, not {precision!r}")
    if batch_size < 1:
        raise KimiInputError(f"pretraining batch size must be positive, not {batch_size}")
    import torch

    if not sequences:
        raise KimiInputError("pretraining needs at least one token sequence")
    prev_det = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    if deterministic:
        import os

        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read by torch's check at each cuBLAS call
        torch.use_deterministic_algorithms(True)
    try:
        return _pretrain(
            model_dir,
            sequences,
            out_dir,
            seconds=seconds,
            max_steps=max_steps,
            batch_size=batch_size,
            lr=lr,
            seed=seed,
            progress=progress,
            device=device,
            schedule=schedule,
            loss=loss,
            precision=precision,
            clock_schedule=not deterministic,
            desc=desc,
        )
    finally:
        torch.use_deterministic_algorithms(prev_det[0], warn_only=prev_det[1])


def _pretrain(
    model_dir,
    sequences,
    out_dir,
    *,
    seconds,
    max_steps,
    batch_size,
    lr,
    seed,
    progress,
    device,
    schedule,
    loss,
    precision,
    clock_schedule,
    desc,
) -> PretrainResult:
    import torch
    import torch.nn.functional as F

    from specforge_kimi.console import Progress
    from specforge_kimi.targets.tiny import write_tiny

    spec, vocab_size, model = _load_tiny_for_training(model_dir, seed, device)
    used = sorted({t for s in sequences for t in s})
    if max(used) >= vocab_size:
        raise KimiInputError(f"token id {max(used)} is outside the target vocab {vocab_size}")
    used_t = torch.tensor(used, device=device)
    remap = torch.full((vocab_size,), -100, dtype=torch.long, device=device)
    remap[used_t] = torch.arange(len(used), device=device)
    seqs = [torch.tensor(s, dtype=torch.long, device=device) for s in sequences if len(s) >= 2]
    # Train embedding/head rows of the used tokens only: a dense update of two
    # 163,840-row matrices per step would cost more than the decoder itself on CPU.
    embed = torch.nn.Parameter(model.model.embed_tokens.weight.detach()[used_t].clone())
    head = torch.nn.Parameter(model.lm_head.weight.detach()[used_t].clone())
    model.model.embed_tokens.weight.requires_grad_(False)
    model.lm_head.weight.requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad] + [embed, head]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    # the V - n_used zero logits the written checkpoint will have, as one softmax term
    sink = math.log(vocab_size - len(used)) if loss == "full" and vocab_size > len(used) else None
    losses: list[float] = []
    start = time.monotonic()
    # sized to the steps the budget allows: max_steps, or fewer when the time budget ends first (re-estimated
    # every step from the rate so far; exact at the end)
    bar = Progress(desc, max_steps, unit="step", enabled=progress)
    step = 0

    def schedule_fraction() -> float:
        frac = step / max_steps
        return max(frac, (time.monotonic() - start) / seconds) if clock_schedule else frac

    while step < max_steps and time.monotonic() - start < seconds:
        if schedule == "cosine":
            scale = cosine_scale(schedule_fraction())
            for group in opt.param_groups:
                group["lr"] = lr * scale
        idx = torch.randint(len(seqs), (batch_size,), generator=gen)
        ids, labels = _padded_batch([remap[seqs[i]] for i in idx], device)
        with torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16, enabled=precision == "bf16"):
            hidden = model.model(inputs_embeds=embed[ids], use_cache=False).last_hidden_state
        logits = (hidden.float() @ head.T).reshape(-1, len(used))
        if sink is not None:
            logits = torch.cat([logits, logits.new_full((logits.shape[0], 1), sink)], dim=1)
        step_loss = F.cross_entropy(logits, labels.reshape(-1), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        step_loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(step_loss.item())
        step += 1
        elapsed = time.monotonic() - start
        bar.retotal(min(max_steps, max(step + 1, int(step * seconds / elapsed))) if elapsed < seconds else step)
        bar.update(1, loss=f"{losses[-1]:.3f}")
    bar.retotal(step)
    bar.close()
    with torch.no_grad():
        model.model.embed_tokens.weight[used_t] = embed.detach()
        model.lm_head.weight.zero_()
        model.lm_head.weight[used_t] = head.detach()
    write_tiny(out_dir, spec, state={k: v.detach().cpu() for k, v in model.state_dict().items()})
    return PretrainResult(
        step,
        time.monotonic() - start,
        losses[0],
        sum(losses[-10:]) / len(losses[-10:]),
        losses,
        schedule_fraction=min(1.0, schedule_fraction()),
    )


def _load_tiny_for_training(model_dir, seed: int, device: str):
    """The tiny checkpoint's spec, vocabulary size and its text model in training mode on ``device``."""
    import torch

    from specforge_kimi.targets.checkpoint import inspect_target, load_text_model
    from specforge_kimi.targets.tiny import TinySpec

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    if "specforge_kimi_tiny" not in cfg:
        raise KimiInputError(f"{model_dir} is not a tiny checkpoint written by `specforge-kimi tiny`")
    spec = TinySpec(**cfg["specforge_kimi_tiny"])
    vocab_size = inspect_target(model_dir).vocab_size
    torch.manual_seed(seed)
    return spec, vocab_size, load_text_model(model_dir).to(device).train()


def _padded_batch(batch, device):
    """Sequences (remapped ids) -> right-padded ids and next-token labels (-100 past each end)."""
    import torch

    T = max(len(s) for s in batch)
    ids = torch.zeros((len(batch), T), dtype=torch.long, device=device)
    labels = torch.full((len(batch), T), -100, dtype=torch.long, device=device)
    for b, s in enumerate(batch):
        ids[b, : len(s)] = s
        labels[b, : len(s) - 1] = s[1:]
    return ids, labels


def pretrain_structured_target(
    out_dir: str | Path,
    spec,
    *,
    seconds: float,
    device: str = "cpu",
    conversations: int = 2000,
    heldout: int = 48,
    batch_size: int = 32,
    lr: float = 2e-3,
    progress: bool = True,
    command: Sequence[str] | None = None,
    schedule: str = "constant",
    loss: str = "full",
    max_steps: int = 10_000,
    deterministic: bool = True,
    precision: str = "fp32",
    prompt_rules: int = 0,
    prompt_rule: str | None = None,
) -> dict:
    """``specforge-kimi tiny OUT --pretrain SECONDS [--pretrain-steps N]``: a tiny K2.5 pretrained on
    :mod:`corpus` for ``seconds`` or ``max_steps`` optimizer steps, whichever ends first (a step-bounded
    target does not depend on how fast the machine happened to be). ``prompt_rules`` (``--pretrain-prompt-rules
    N``) adds N prompt-mix prompts answered by :mod:`prompt_rules`'s ``prompt_rule``, so that the target answers the bench's
    chat/math/code prompts by a rule too; the rule's held-out numbers are then taken on the bench's own prompts.

    Writes the checkpoint, the stand-in tokenizer (byte-level, K2.5 special ids and its text-only
    chat template, so SGLang can serve it), ``pretrain.json`` (corpus, loss curve, held-out loss
    and greedy accuracy on the answer tokens of ``heldout`` conversations drawn with
    ``HELDOUT_SEED`` -- the conversations the bench's ``structured`` prompt set asks) and
    ``pretrain_loss.png``. Returns the ``pretrain.json`` content.
    """
    import sys
    from dataclasses import asdict

    from specforge_kimi.data.tokenizer import build_standin_tokenizer
    from specforge_kimi.targets.checkpoint import resolve_device

    prompt_rule = _check_pretrain_args(seconds, max_steps, batch_size, prompt_rules, prompt_rule, precision)
    device = resolve_device(device)
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise KimiInputError(f"{out} exists and is not empty")
    tok = build_standin_tokenizer()
    rows = _pretrain_rows(tok, conversations, heldout, prompt_rules, prompt_rule)
    res = _pretrain_from_random(
        out,
        spec,
        [ids for ids, _ in rows.train + rows.rules],
        seconds=seconds,
        batch_size=batch_size,
        lr=lr,
        progress=progress,
        device=device,
        schedule=schedule,
        loss=loss,
        max_steps=max_steps,
        deterministic=deterministic,
        precision=precision,
    )
    tok.save_pretrained(out)

    held, rule_held_numbers = _score_heldout(out, rows, device)
    summary = {
        "command": list(command) if command is not None else sys.argv,
        "spec": asdict(spec),
        "device": device,
        "corpus": _corpus_summary(conversations, rows.train),
        "train": _train_summary(
            res,
            max_steps=max_steps,
            seconds=seconds,
            deterministic=deterministic,
            precision=precision,
            batch_size=batch_size,
            lr=lr,
            schedule=schedule,
            loss=loss,
        ),
        "heldout": _heldout_summary(heldout, held),
    }
    if spec.int4_experts:
        summary["quantization"] = (
            "routed experts trained in full precision, then written as K2.5's INT4 "
            "(compressed-tensors pack-quantized, group 32); the held-out numbers above are "
            "the written, quantized checkpoint's"
        )
    if prompt_rules:
        summary["prompt_rules"] = _rules_summary(prompt_rule, prompt_rules, rows, rule_held_numbers)
    write_atomic(out / "pretrain.json", json.dumps(summary, indent=2))
    _plot_pretrain(res.losses, summary, out / "pretrain_loss.png")
    return summary


def _pretrain_from_random(out: Path, spec, sequences: list, **kwargs) -> PretrainResult:
    """A random tiny target of ``spec`` written beside ``out`` and pretrained into ``out``; the random one removed."""
    import shutil

    from specforge_kimi.targets.tiny import write_tiny

    raw = out.with_name(out.name + ".random")
    shutil.rmtree(raw, ignore_errors=True)
    try:
        write_tiny(raw, spec)
        return pretrain(str(raw), sequences, str(out), seed=spec.seed, **kwargs)
    finally:
        shutil.rmtree(raw, ignore_errors=True)


def _check_pretrain_args(
    seconds: float, max_steps: int, batch_size: int, prompt_rules: int, prompt_rule: str | None, precision: str
) -> str:
    """One line for each bad ``--pretrain*`` value; returns the prompt rule to use."""
    from specforge_kimi.demo import prompt_rules as rules

    if seconds <= 0:
        raise KimiInputError("--pretrain SECONDS must be positive")
    if max_steps <= 0:
        raise KimiInputError("--pretrain-steps must be positive")
    if batch_size < 1:
        raise KimiInputError("--pretrain-batch-size must be positive")
    if prompt_rules < 0:
        raise KimiInputError("--pretrain-prompt-rules must be >= 0")
    prompt_rule = prompt_rule or rules.DEFAULT_RULE
    if prompt_rule not in rules.RULES:
        raise KimiInputError(f"--pretrain-prompt-rule {prompt_rule!r}: choose one of {sorted(rules.RULES)}")
    if precision not in ("fp32", "bf16"):
        raise KimiInputError(f"--pretrain-precision must be fp32 or bf16, not {precision!r}")
    return prompt_rule


class _Rows(NamedTuple):
    """Encoded (ids, loss mask) rows: the corpus's training and held-out conversations, the prompt-rule
    conversations trained on and the bench's prompts answered by the rule (held out)."""

    train: list
    heldout: list
    rules: list
    rules_heldout: list


def _pretrain_rows(tok, conversations: int, heldout: int, prompt_rules: int, prompt_rule: str) -> _Rows:
    from specforge_kimi.data import corpus
    from specforge_kimi.data.chat_template import encode_records as _rows
    from specforge_kimi.data.corpus import HELDOUT_SEED, TRAIN_SEED
    from specforge_kimi.demo import prompt_rules as rules

    train_rows = _rows(list(corpus.conversations(conversations, seed=TRAIN_SEED)), tok)
    held_rows = _rows(list(corpus.conversations(heldout, seed=HELDOUT_SEED)), tok)
    rule_rows, rule_held = [], []
    if prompt_rules:
        try:
            rule_rows = _rows(list(rules.conversations(prompt_rules, rule=prompt_rule)), tok)
        except ValueError as e:  # more than the prompt templates can make
            raise KimiInputError(f"--pretrain-prompt-rules {prompt_rules}: {e}") from e
        rule_held = _rows(rules.bench_conversations(prompt_rule), tok)
    return _Rows(train_rows, held_rows, rule_rows, rule_held)


def _score_heldout(out: Path, rows: _Rows, device: str) -> tuple[dict, dict | None]:
    """The written target's own held-out numbers, full 163,840-way softmax (unused head rows are zero)."""
    import torch

    from specforge_kimi.targets.checkpoint import load_text_model

    model = load_text_model(str(out)).to(device).eval()
    used = torch.tensor(sorted({t for ids, _ in rows.train + rows.rules for t in ids}), device=device)
    held = _heldout_numbers(model, rows.heldout, used, device)
    rule_held_numbers = _heldout_numbers(model, rows.rules_heldout, used, device) if rows.rules_heldout else None
    return held, rule_held_numbers


def _corpus_summary(conversations: int, train_rows: list) -> dict:
    from specforge_kimi.data import corpus
    from specforge_kimi.data.corpus import TRAIN_SEED

    return {
        "module": "specforge_kimi.data.corpus",
        "tasks": [t.__name__.lstrip("_") for t in corpus.TASKS],
        "conversations": conversations,
        "seed": TRAIN_SEED,
        "rows": len(train_rows),
        "tokens": sum(len(i) for i, _ in train_rows),
        "what": "synthetic user question -> rule-determined answer (counting, spelling, reversing, repeating, "
        "multiplication tables, colour cycles); every 2nd conversation answers with reasoning; "
        "rendered with the kimi-k2.5 template, stand-in tokenizer (byte-level ids)",
    }


def _train_summary(
    res: PretrainResult,
    *,
    max_steps: int,
    seconds: float,
    deterministic: bool,
    precision: str,
    batch_size: int,
    lr: float,
    schedule: str,
    loss: str,
) -> dict:
    return {
        "steps": res.steps,
        "max_steps": max_steps,
        "seconds": round(res.seconds, 2),
        "seconds_budget": seconds,
        "deterministic": deterministic,
        "precision": precision,
        "batch_size": batch_size,
        "lr": lr,
        "lr_schedule": schedule,
        "schedule_fraction": round(res.schedule_fraction, 4),
        "schedule_over": "steps" if deterministic else "time or steps, whichever ends first",
        "loss": loss,
        "loss_first": res.first_loss,
        "loss_last": res.last_loss,
        "losses": res.losses,
        "what": "next-token cross-entropy over every position; "
        + (
            "full vocabulary (the untrained tokens' zero logits as one log(V - n) term)"
            if loss == "full"
            else "softmax restricted to the corpus's tokens"
        ),
    }


def _heldout_summary(heldout: int, held: dict) -> dict:
    from specforge_kimi.data.corpus import HELDOUT_SEED

    return {
        "conversations": heldout,
        "seed": HELDOUT_SEED,
        **held,
        "what": "on the answer (loss-mask) tokens of the held-out conversations, i.e. the bench's "
        "`structured` prompt set: cross-entropy over the full vocab (unused head rows are 0, "
        "so ~log(163840) until trained logits grow), the same restricted to the corpus's "
        "tokens, full-vocab argmax accuracy (what SGLang's greedy decoding picks) and the "
        "argmax accuracy among the corpus's tokens; the two differ when untrained tokens "
        "outscore every trained one",
    }


def _rules_summary(prompt_rule: str, prompt_rules: int, rows: _Rows, rule_held_numbers: dict | None) -> dict:
    from specforge_kimi.demo import prompt_rules as rules

    return {
        "module": "specforge_kimi.demo.prompt_rules",
        "rule": prompt_rule,
        "conversations": prompt_rules,
        "seed": rules.PRETRAIN_SEED,
        "rows": len(rows.rules),
        "tokens": sum(len(i) for i, _ in rows.rules),
        "what": f"prompt_mix chat/math/code prompts answered by the {prompt_rule!r} rule: "
        f"{rules.RULES[prompt_rule][1]}; every 2nd with reasoning; trained on beside the corpus",
        "heldout": {
            "conversations": len(rows.rules_heldout),
            **(rule_held_numbers or {}),
            "what": "the same numbers on the bench's own chat/math/code prompts answered by the rule "
            "(never trained on)",
        },
    }


def _heldout_numbers(model, rows, used, device) -> dict:
    """Answer-token cross-entropy and greedy accuracy of ``model`` on ``rows`` (ids, loss mask): over the
    full vocabulary and restricted to the ``used`` (trained) tokens."""
    import torch
    import torch.nn.functional as F

    nll, nll_used, correct, correct_used, n, n_known = 0.0, 0.0, 0, 0, 0, 0
    with torch.no_grad():
        for ids, mask in rows:
            x = torch.tensor([ids], device=device)
            logits = model(input_ids=x).logits[0, :-1].float()
            m = torch.tensor(mask[1:], device=device, dtype=torch.bool)
            y = x[0, 1:]
            nll += F.cross_entropy(logits[m], y[m], reduction="sum").item()
            # restricted to the corpus's tokens, comparable with the training loss: over the answer tokens
            # the training rows use (a token they never use has no place among them; counted apart)
            pos = torch.searchsorted(used, y[m]).clamp(max=len(used) - 1)
            known = used[pos] == y[m]
            lu = logits[m][:, used]
            nll_used += F.cross_entropy(lu[known], pos[known], reduction="sum").item()
            correct += int((logits[m].argmax(-1) == y[m]).sum())
            correct_used += int((lu.argmax(-1) == pos)[known].sum())
            n += int(m.sum())
            n_known += int(known.sum())
    return {
        "answer_tokens": n,
        "loss": nll / max(n, 1),
        "loss_corpus_tokens": nll_used / max(n_known, 1),
        "greedy_accuracy": correct / max(n, 1),
        "greedy_accuracy_corpus_tokens": correct_used / max(n_known, 1),
        "answer_tokens_unused_in_training": n - n_known,
    }


def _plot_pretrain(losses: list[float], summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.4))
    full = summary["train"].get("loss") == "full"
    ax.plot(
        range(1, len(losses) + 1),
        losses,
        lw=0.8,
        label="train (full-vocab softmax)" if full else "train (restricted softmax)",
    )
    h = summary["heldout"]
    held = h["loss"] if full else h["loss_corpus_tokens"]
    ax.axhline(
        held,
        color="C3",
        ls="--",
        lw=1,
        label=f"held-out answer tokens {held:.3f} (greedy acc {h['greedy_accuracy']:.2f})",
    )
    ax.set(xlabel="step", ylabel="cross-entropy", title="tiny K2.5 target pretraining on the structured corpus")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
