"""Brief pretraining of a tiny K2.5 target so that its predictions carry structure.

Scope: tiny, unquantized checkpoints on CPU or one GPU. Trains transformers'
``DeepseekV3ForCausalLM`` (loaded by :func:`target.load_text_model`) on token sequences with a
next-token loss restricted to the tokens the corpus uses (the full 163,840-entry softmax would
dominate CPU time); LM-head rows of tokens the corpus never uses are zeroed afterwards, so those
tokens score 0 and the trained tokens win the argmax. The result is written back in K2.5's
on-disk naming (:func:`tiny.write_tiny` with ``state=``).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from specforge_kimi.errors import KimiInputError


@dataclass
class PretrainResult:
    steps: int
    seconds: float
    first_loss: float
    last_loss: float
    losses: list[float]


def pretrain(model_dir: str, sequences: Sequence[Sequence[int]], out_dir: str, *, seconds: float = 60.0,
             max_steps: int = 10_000, batch_size: int = 8, lr: float = 2e-3, seed: int = 0,
             progress: bool = True, device: str = "cpu") -> PretrainResult:
    """Train ``model_dir``'s text model on ``sequences`` for at most ``seconds``; write ``out_dir``."""
    import torch
    import torch.nn.functional as F
    from tqdm import tqdm

    from specforge_kimi.target import inspect_target, load_text_model
    from specforge_kimi.tiny import TinySpec, write_tiny

    if not sequences:
        raise KimiInputError("pretraining needs at least one token sequence")
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    if "specforge_kimi_tiny" not in cfg:
        raise KimiInputError(f"{model_dir} is not a tiny checkpoint written by `specforge-kimi tiny`")
    spec = TinySpec(**cfg["specforge_kimi_tiny"])
    info = inspect_target(model_dir)
    torch.manual_seed(seed)
    model = load_text_model(model_dir).to(device).train()
    used = sorted({t for s in sequences for t in s})
    if max(used) >= info.vocab_size:
        raise KimiInputError(f"token id {max(used)} is outside the target vocab {info.vocab_size}")
    used_t = torch.tensor(used, device=device)
    remap = torch.full((info.vocab_size,), -100, dtype=torch.long, device=device)
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
    losses: list[float] = []
    start = time.monotonic()
    bar = tqdm(total=max_steps, desc="pretrain tiny target", disable=not progress, unit="step")
    step = 0
    while step < max_steps and time.monotonic() - start < seconds:
        idx = torch.randint(len(seqs), (batch_size,), generator=gen)
        batch = [remap[seqs[i]] for i in idx]
        T = max(len(s) for s in batch)
        ids = torch.zeros((len(batch), T), dtype=torch.long, device=device)
        labels = torch.full((len(batch), T), -100, dtype=torch.long, device=device)
        for b, s in enumerate(batch):
            ids[b, : len(s)] = s
            labels[b, : len(s) - 1] = s[1:]
        hidden = model.model(inputs_embeds=embed[ids], use_cache=False).last_hidden_state
        logits = hidden @ head.T
        loss = F.cross_entropy(logits.reshape(-1, len(used)).float(), labels.reshape(-1), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(loss.item())
        step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    bar.close()
    with torch.no_grad():
        model.model.embed_tokens.weight[used_t] = embed.detach()
        model.lm_head.weight.zero_()
        model.lm_head.weight[used_t] = head.detach()
    write_tiny(out_dir, spec, state={k: v.detach().cpu() for k, v in model.state_dict().items()})
    return PretrainResult(step, time.monotonic() - start, losses[0], sum(losses[-10:]) / len(losses[-10:]), losses)
