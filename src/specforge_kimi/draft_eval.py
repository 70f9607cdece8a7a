"""Simulated acceptance of a run's checkpoints on held-out conversations, captured on the spot.

Scope: tiny or small targets that fit one device in transformers (the reference capture of
:mod:`capture`); Llama-style EAGLE-3 drafts as SpecForge builds them. For each checkpoint of a
run (and for the untrained draft with the same config and seed) it reports
:func:`simulate.simulated_acceptance` (chain, top-k 1, greedy) and SpecForge's held-out loss,
so an online run can show "acceptance rising" without a serving engine. The engine's own number
comes from ``specforge-kimi bench``.

    specforge-kimi eval-draft --target DIR --draft-config draft_config.json \
        --vocab-mapping vocab_mapping.pt --aux-ids 1,3,4 --checkpoints RUN/run-step100 RUN/run-step300 \
        --heldout 48 --out eval.json
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from specforge_kimi.errors import KimiInputError

from specforge_kimi.pretrain import HELDOUT_SEED  # held-out corpus conversations (the bench's `structured` set)


def heldout_rows(n: int, seed: int = HELDOUT_SEED, tokenizer_dir: Optional[str] = None) -> list[tuple[list[int], list[int]]]:
    """``n`` corpus conversations rendered as training rows (ids, loss mask)."""
    from specforge_kimi import corpus
    from specforge_kimi.demo import _rows
    from specforge_kimi.tokenizer import build_standin_tokenizer, load_tokenizer

    tok = load_tokenizer(tokenizer_dir) if tokenizer_dir else build_standin_tokenizer()
    return _rows(list(corpus.conversations(n, seed=seed)), tok)


def capture_rows(target_dir: str, rows, aux_specforge_ids: Sequence[int], device: str = "cpu") -> list[dict]:
    """Reference capture of ``rows`` -> SpecForge offline-format samples (fp32, on the CPU)."""
    import torch

    from specforge_kimi.demo import capture_samples
    from specforge_kimi.layer_ids import AuxLayers
    from specforge_kimi.target import inspect_target, load_text_model

    info = inspect_target(target_dir)
    aux = AuxLayers.from_specforge(aux_specforge_ids, info.num_layers)
    model = load_text_model(target_dir).to(device)
    samples = dict(capture_samples(model, rows, aux, torch.float32))
    del model
    return [samples[i] for i in range(len(rows))]


def evaluate(target_dir: str, draft_config: str, vocab_mapping: str, aux_specforge_ids: Sequence[int],
             checkpoints: Sequence[str], *, heldout: int = 48, steps: int = 3, seed: int = 0,
             device: str = "cpu") -> dict:
    """Simulated acceptance + held-out loss of the untrained draft and of each checkpoint."""
    import torch
    from specforge.export.checkpoint_io import resolve_training_state

    import specforge_kimi
    from specforge_kimi.demo import _load_draft, load_head_weight
    from specforge_kimi.simulate import add_target_greedy, simulated_acceptance
    from specforge_kimi.target import inspect_target

    specforge_kimi.register()
    for c in checkpoints:
        if not Path(c).exists():
            raise KimiInputError(f"checkpoint {c} does not exist")
    info = inspect_target(target_dir)
    t0 = time.monotonic()
    tok_dir = target_dir if (Path(target_dir) / "tokenizer_config.json").is_file() else None
    samples = capture_rows(target_dir, heldout_rows(heldout, tokenizer_dir=tok_dir), aux_specforge_ids, device)
    head = load_head_weight(target_dir, info)
    mapping = torch.load(vocab_mapping)
    add_target_greedy(samples, head, t2d=mapping["t2d"])
    results = []
    torch.manual_seed(seed)
    for label, ckpt in [("untrained", None), *[(str(c), c) for c in checkpoints]]:
        state = resolve_training_state(str(ckpt))["draft_state_dict"] if ckpt else None
        draft = _load_draft(draft_config, target_dir, info.embedding_key, vocab_mapping, state=state)
        r = simulated_acceptance(draft, head, samples, steps)
        results.append({"checkpoint": label, "mean_acceptance_length": r.mean_acceptance_length,
                        "per_step_accuracy": r.per_step_accuracy, "chains": r.chains,
                        "heldout_loss": r.heldout_loss, "teacher_entropy": r.teacher_entropy})
    return {"command": sys.argv, "target": str(target_dir), "heldout_conversations": heldout,
            "heldout_seed": HELDOUT_SEED, "steps": steps, "topk": 1, "results": results,
            "seconds": round(time.monotonic() - t0, 2)}


def add_parser(sub) -> None:
    p = sub.add_parser("eval-draft", help="simulated acceptance of checkpoints on held-out corpus conversations")
    p.add_argument("--target", required=True)
    p.add_argument("--draft-config", required=True)
    p.add_argument("--vocab-mapping", required=True)
    p.add_argument("--aux-ids", required=True, help="SpecForge aux layer ids, e.g. 1,3,4")
    p.add_argument("--checkpoints", nargs="*", default=[])
    p.add_argument("--heldout", type=int, default=48)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", default=None, help="write the JSON here too")
    p.set_defaults(func=run)


def run(args) -> int:
    res = evaluate(args.target, args.draft_config, args.vocab_mapping, [int(x) for x in args.aux_ids.split(",")],
                   args.checkpoints, heldout=args.heldout, steps=args.steps, device=args.device)
    text = json.dumps(res, indent=2)
    if args.out:
        Path(args.out).write_text(text)
    for r in res["results"]:
        print(f"{r['checkpoint']}: simulated acceptance {r['mean_acceptance_length']:.3f}, "
              f"held-out loss {r['heldout_loss']:.3f}")
    return 0
