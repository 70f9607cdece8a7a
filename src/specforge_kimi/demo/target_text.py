"""How predictable a target's own greedy text is: the yardstick for choosing a tiny target.

A draft is only as good as its target is predictable. On the tiny targets, acceptance followed the
entropy of the target's next-token distribution along its own greedy text far more than anything
in the draft's training (bench/REPORT.md, "Choosing the tiny target" and "Draft evaluation"), and
targets from the same command differ a lot. This module generates that text (transformers ``generate``,
greedy, stopping at ``<|im_end|>``) for *selection* prompts, none of them a bench prompt: distinct corpus
conversations drawn with :data:`SELECT_SEED` (the prompt part, in each conversation's thinking
mode), skipping the bench's ``structured`` ones, and a :mod:`prompt_mix` stream with its own seed
(thinking on, as the bench asks its chat/math/code sets; prompt_mix never yields a bench prompt).
The corpus is templated (2,000 training conversations hold 719 distinct prompts), so corpus
selection prompts are mostly also training prompts, as the bench's ``structured`` ones are.
Along the generated tokens it measures the full-vocabulary entropy (nats, the softmax the engine
samples from), the mean top-1 probability, the distinct tokens and the share of answers finished.

``specforge-kimi target-text DIR [DIR ...]`` measures each candidate and names the one with the
lowest mean entropy over all generated tokens (``scripts/gpu_online_run.sh`` with
``TARGET_SEEDS``). Scope: text-only tiny K2.5 targets written by ``specforge-kimi tiny``; one
device; no SGLang.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from specforge_kimi.durable import write_atomic
from specforge_kimi.errors import KimiInputError

#: Corpus seed of the selection prompts (training uses ``pretrain.TRAIN_SEED``, the bench's
#: ``structured`` set ``pretrain.HELDOUT_SEED``).
SELECT_SEED = 30_000
#: Seed of the selection prompt-mix stream (``gpu_online_run.sh`` trains on the seed-0 stream).
SELECT_MIX_SEED = 7


def greedy_continue(
    model,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    eos_id: int,
    pad_id: int = 0,
    batch: int = 16,
    device: str = "cpu",
) -> list[list[int]]:
    """The model's greedy continuation of each prompt (left-padded batches of similar length),
    cut after ``eos_id`` when it appears."""
    import torch

    out: list[list[int]] = [[] for _ in prompts]
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    with torch.no_grad():
        for b in range(0, len(order), batch):
            idx = order[b : b + batch]
            T = max(len(prompts[i]) for i in idx)
            ids = torch.full((len(idx), T), pad_id, dtype=torch.long)
            att = torch.zeros((len(idx), T), dtype=torch.long)
            for k, i in enumerate(idx):
                ids[k, T - len(prompts[i]) :] = torch.tensor(list(prompts[i]))
                att[k, T - len(prompts[i]) :] = 1
            gen = model.generate(
                input_ids=ids.to(device),
                attention_mask=att.to(device),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=eos_id,
                pad_token_id=pad_id,
            )
            for k, i in enumerate(idx):
                new = gen[k, T:].tolist()
                out[i] = new[: new.index(eos_id) + 1] if eos_id in new else new
    return out


def text_stats(
    model, prompts: Sequence[Sequence[int]], continuations: Sequence[Sequence[int]], *, eos_id: int, device: str = "cpu"
) -> dict:
    """Entropy and top-1 probability of the model's next-token distribution at every generated
    token of ``continuations`` (given its prompt), pooled over tokens."""
    import torch

    ent = top1 = 0.0
    n = finished = 0
    distinct: set[int] = set()
    with torch.no_grad():
        for p, c in zip(prompts, continuations, strict=False):
            if not c:
                continue
            x = torch.tensor([list(p) + list(c)], device=device)
            logits = model(input_ids=x).logits[0, len(p) - 1 : len(p) - 1 + len(c)].float()
            logp = torch.log_softmax(logits, dim=-1)
            ent += float(-(logp.exp() * logp).sum(-1).sum())
            top1 += float(logp.max(-1).values.exp().sum())
            n += len(c)
            finished += int(c[-1] == eos_id)
            distinct.update(c)
    return {
        "prompts": len(prompts),
        "generated_tokens": n,
        "mean_entropy": ent / max(n, 1),
        "mean_top1_probability": top1 / max(n, 1),
        "distinct_tokens": len(distinct),
        "finished_share": finished / max(len(prompts), 1),
    }


def prompt_part(ids: Sequence[int], mask: Sequence[int]) -> list[int]:
    """The prompt of a training row: every token before the first trained one (all of it if none is)."""
    return list(ids[: mask.index(1)] if 1 in mask else ids)


def selection_prompts(tokenizer, *, corpus_prompts: int, mix_prompts: int) -> dict[str, list[list[int]]]:
    """``{"corpus": [...], "prompt_mix": [...]}``: token ids of the selection prompts, rendered as
    the bench renders its requests."""
    from specforge_kimi.data import corpus, prompt_mix
    from specforge_kimi.data.chat_template import encode_records as _rows
    from specforge_kimi.data.conversation import Message
    from specforge_kimi.data.corpus import HELDOUT_SEED
    from specforge_kimi.evaluate.bench import Prompt, encode_prompt

    def prompts_of(records):  # single-turn corpus: one row per conversation
        return [tuple(prompt_part(ids, mask)) for ids, mask in _rows(records, tokenizer)]

    groups: dict[str, list[list[int]]] = {}
    if corpus_prompts:
        seen = set(prompts_of(list(corpus.conversations(48, seed=HELDOUT_SEED))))  # the bench's structured set
        chosen: list[list[int]] = []
        for rec in corpus.conversations(corpus_prompts * 100, seed=SELECT_SEED):
            p = prompts_of([rec])[0]
            if p not in seen:
                seen.add(p)
                chosen.append(list(p))
                if len(chosen) == corpus_prompts:
                    break
        else:
            raise KimiInputError(f"the corpus has fewer than {corpus_prompts} distinct non-bench prompts")
        groups["corpus"] = chosen
    if mix_prompts:
        groups["prompt_mix"] = [
            encode_prompt(
                Prompt(id=f"select-{i}", messages=(Message(role="user", content=t),)), tokenizer, thinking=True
            )
            for i, (_, t) in enumerate(prompt_mix.prompts(mix_prompts, seed=SELECT_MIX_SEED))
        ]
    return groups


def measure(
    target_dir: str | Path,
    *,
    device: str = "cpu",
    corpus_prompts: int = 48,
    mix_prompts: int = 48,
    max_new_tokens: int = 128,
) -> dict:
    """:func:`text_stats` of one target on the selection prompts, per group and pooled."""
    from transformers import AutoTokenizer

    from specforge_kimi.targets.checkpoint import load_text_model

    target_dir = Path(target_dir)
    if not (target_dir / "tokenizer_config.json").is_file():
        raise KimiInputError(f"{target_dir} has no tokenizer (expected a target written by `specforge-kimi tiny`)")
    tok = AutoTokenizer.from_pretrained(str(target_dir))
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    if not isinstance(eos, int) or eos == tok.unk_token_id:
        raise KimiInputError(f"{target_dir}: its tokenizer has no <|im_end|> token")
    t0 = time.monotonic()
    model = load_text_model(str(target_dir)).to(device).eval()
    res: dict = {"target": str(target_dir), "groups": {}}
    pooled_e = pooled_t = pooled_n = 0.0
    for name, prompts in selection_prompts(tok, corpus_prompts=corpus_prompts, mix_prompts=mix_prompts).items():
        cont = greedy_continue(model, prompts, max_new_tokens=max_new_tokens, eos_id=eos, device=device)
        st = text_stats(model, prompts, cont, eos_id=eos, device=device)
        res["groups"][name] = st
        pooled_e += st["mean_entropy"] * st["generated_tokens"]
        pooled_t += st["mean_top1_probability"] * st["generated_tokens"]
        pooled_n += st["generated_tokens"]
    res["mean_entropy"] = pooled_e / max(pooled_n, 1)
    res["mean_top1_probability"] = pooled_t / max(pooled_n, 1)
    res["generated_tokens"] = int(pooled_n)
    pre = target_dir / "pretrain.json"
    if pre.is_file():
        p = json.loads(pre.read_text())
        res["pretrain"] = {
            "seed": p.get("spec", {}).get("seed"),
            "steps": p.get("train", {}).get("steps"),
            "deterministic": p.get("train", {}).get("deterministic"),
            "heldout_greedy_accuracy": p.get("heldout", {}).get("greedy_accuracy"),
        }
    res["seconds"] = round(time.monotonic() - t0, 2)
    return res


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``target-text`` command's arguments (``specforge_kimi.cli.COMMANDS`` declares the command)."""
    p.add_argument("targets", nargs="+", help="target directories (written by `specforge-kimi tiny`)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    p.add_argument(
        "--corpus-prompts", type=int, default=48, help="selection prompts from the corpus (none a bench prompt)"
    )
    p.add_argument("--mix-prompts", type=int, default=48, help="selection prompts from the chat/math/code prompt mix")
    p.add_argument("--max-new-tokens", type=int, default=128, help="greedy tokens generated per prompt")
    p.add_argument("--out", default=None, help="write the JSON here")


def run(args: argparse.Namespace) -> int:
    from specforge_kimi.targets.checkpoint import resolve_device

    if (
        min(args.corpus_prompts, args.mix_prompts) < 0
        or args.corpus_prompts + args.mix_prompts == 0
        or args.max_new_tokens < 1
    ):
        raise KimiInputError("need at least one selection prompt and --max-new-tokens >= 1")
    device = resolve_device(args.device)
    results = [
        measure(
            t,
            device=device,
            corpus_prompts=args.corpus_prompts,
            mix_prompts=args.mix_prompts,
            max_new_tokens=args.max_new_tokens,
        )
        for t in args.targets
    ]
    best = min(results, key=lambda r: r["mean_entropy"])
    summary = {
        "command": sys.argv,
        "device": device,
        "select_seed": SELECT_SEED,
        "select_mix_seed": SELECT_MIX_SEED,
        "max_new_tokens": args.max_new_tokens,
        "candidates": results,
        "chosen": best["target"],
        "criterion": "lowest mean entropy of the target's next-token distribution over its own greedy tokens",
    }
    for r in results:
        groups = "; ".join(
            f"{g} {s['mean_entropy']:.3f} ({s['distinct_tokens']} distinct, {s['finished_share']:.0%} finished)"
            for g, s in r["groups"].items()
        )
        print(
            f"{r['target']}: entropy {r['mean_entropy']:.3f}, top-1 p {r['mean_top1_probability']:.3f} over "
            f"{r['generated_tokens']} tokens; {groups}"
        )
    print(f"chosen: {best['target']}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        write_atomic(args.out, json.dumps(summary, indent=2))
    return 0
