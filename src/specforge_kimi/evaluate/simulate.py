"""Simulated acceptance length of an EAGLE-3 draft on held-out captured features.

Scope: chain drafting with top-k 1 and greedy verification (SGLang ``--speculative-eagle-topk 1``),
computed offline from captured target features. It unrolls SpecForge's own TTT recurrence (the
same draft calls ``OnlineEagle3Model.forward`` makes with the sdpa backend): at step ``j`` the
draft, fed its own previous hidden state and the token at ``t+1+j``, predicts the target's greedy
token at ``t+2+j``. A chain starting after position ``t`` accepts while every step so far matched
the target's argmax; acceptance length = 1 (the target's own token) + accepted draft tokens,
averaged over start positions whose predicted tokens are all trained (loss-masked) tokens.

That average weighs every position alike; serving does not. A decode round starts right after the
previous round's bonus token, i.e. where the draft just failed, and failures cluster, so the
engine's acceptance is lower than the every-position average. :func:`serving_rounds` walks the
rounds as SGLang's decode loop takes them -- first round after the prompt, next one after each
round's accepted drafts and bonus token -- and reports the acceptance length over those rounds
and, per draft position, the share of rounds that accepted at least that many drafts (what
SGLang's ``spec_correct_drafts_histogram`` gives, so the bench's ``at_least`` compares directly).
Because the inputs are teacher-forced data tokens, this equals real greedy speculation only
when the data is the target's own greedy output; otherwise it is an estimate. The real number
comes from SGLang's speculative decoding (the bench command).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


def add_target_greedy(samples: list[dict], target_head_weight, t2d=None) -> None:
    """Cache per sample the target's greedy tokens (``target_greedy`` [L]) and, with ``t2d``, its
    distribution over the draft vocab (``target_p_draft`` [L, V_draft], SpecForge's ``target_p``:
    softmax of the target logits restricted to the draft vocab). Reused across drafts."""
    import torch

    w = target_head_weight.float()
    with torch.no_grad():
        for s in samples:
            logits = s["hidden_state"].reshape(-1, w.shape[1]).float() @ w.T
            s["target_greedy"] = logits.argmax(-1)
            if t2d is not None:
                s["target_p_draft"] = torch.softmax(logits[:, t2d.bool()], dim=-1)


@dataclass
class AcceptanceResult:
    mean_acceptance_length: float
    per_step_accuracy: list[float]  # P(step j correct | steps < j correct)
    chains: int
    #: SpecForge's per-position loss (-sum target_p log q, target_p over the draft vocab) averaged
    #: over TTT steps and trained positions; None unless ``target_p_draft`` was cached.
    heldout_loss: float | None = None
    #: mean entropy of target_p over the same positions: the floor of ``heldout_loss`` (KL = loss - this)
    teacher_entropy: float | None = None
    #: acceptance length over decode rounds as the engine takes them (:func:`serving_rounds`)
    serving_acceptance_length: float | None = None
    #: share of those rounds that accepted at least j+1 draft tokens, j = 0..steps-1
    serving_at_least: list[float] | None = None
    serving_rounds: int = 0


def serving_rounds(length: list[int], trained: list[bool]) -> list[int]:
    """Acceptance lengths of the decode rounds over one sample, in order.

    ``length[t]``: 1 + drafts accepted by a chain that starts after position ``t`` (it predicts
    token ``t+2`` first); ``trained[i]``: token ``i`` is generated (loss-masked). For each run of
    generated tokens ``a..b``, the target's prefill emits token ``a``, so the first round starts
    at ``t = a-1``; a round accepting ``n`` tokens (drafts + bonus) moves the next start to
    ``t + n``; rounds stop once no generated token is left to draft (``t + 2 > b``)."""
    out: list[int] = []
    L = len(trained)
    i = 0
    while i < L:
        if not trained[i] or i == 0:
            i += 1
            continue
        b = i
        while b + 1 < L and trained[b + 1]:
            b += 1
        t = i - 1
        while t + 2 <= b:
            n = max(1, int(length[t]))
            out.append(n)
            t += n
        i = b + 1
    return out


def _shift(t, n: int):
    import torch

    if n == 0:
        return t
    pad = torch.zeros_like(t[:, :n])
    return torch.cat([t[:, n:], pad], dim=1)


def simulated_acceptance(draft, target_head_weight, samples: Iterable[dict], steps: int) -> AcceptanceResult:
    """``samples``: dicts with ``input_ids`` [L], ``loss_mask`` [L], ``aux_hidden_state`` [1,L,3H],
    ``hidden_state`` [1,L,H] (SpecForge's offline feature format). ``draft``: a SpecForge
    ``Eagle3DraftModel`` with ``t2d``/``d2t`` loaded."""
    import torch

    draft = draft.eval()
    dtype = next(draft.parameters()).dtype
    w = target_head_weight.to(dtype)
    total_len, chains = 0.0, 0
    reached = [0] * (steps + 1)
    correct_at = [0] * steps
    loss_sum, loss_n, ent_sum = 0.0, 0, 0.0
    rounds: list[int] = []
    with torch.no_grad():
        for s in samples:
            ids = s["input_ids"].reshape(1, -1).long()
            mask = s["loss_mask"].reshape(1, -1).long()
            L = ids.shape[1]
            if L < 3:
                continue
            aux = s["aux_hidden_state"].reshape(1, L, -1).to(dtype)
            last = s["hidden_state"].reshape(1, L, -1).to(dtype)
            greedy = s.get("target_greedy")
            if greedy is None:
                greedy = (last @ w.T).argmax(-1)  # at i: the target's greedy token i+1
            target_tok = _shift(greedy.reshape(1, L), 1)  # at t: the target's greedy token t+2
            inp = _shift(ids, 1)  # token t+1 at t
            valid0 = _shift(mask, 2)  # token t+2 is a trained token
            hidden = draft.project_hidden_states(aux)
            pos = torch.arange(L).unsqueeze(0)
            attn = draft.prepare_decoder_attention_mask(
                attention_mask=torch.ones(1, L, dtype=torch.bool),
                hidden_states=hidden,
                batch_size=1,
                seq_length=L,
                past_key_values_length=0,
            )
            cache_hidden = [[], []]
            ok = valid0.bool().clone()
            start = ok.clone()
            length = ok.long()
            for j in range(steps):
                emb = draft.embed_input_ids(_shift(inp, j)).to(dtype)
                hidden = draft.backbone(
                    input_embeds=emb,
                    hidden_states=hidden,
                    cache_hidden=cache_hidden,
                    attention_mask=attn,
                    position_ids=pos,
                    past_key_values=None,
                    use_cache=True,
                )
                logits = draft.compute_logits(hidden)
                pred = logits.argmax(-1)
                tp = s.get("target_p_draft")
                if tp is not None:
                    # draft step j at position t predicts what the target predicts at t+1+j
                    tp_j = _shift(tp.reshape(1, L, -1), 1 + j).to(logits.dtype)
                    ce = -(tp_j * torch.log_softmax(logits.float(), -1)).sum(-1)
                    valid = _shift(mask, 2 + j).bool()
                    ent = -(tp_j * torch.log(tp_j.clamp_min(1e-30))).sum(-1)
                    loss_sum += float(ce[valid].sum())
                    ent_sum += float(ent[valid].sum())
                    loss_n += int(valid.sum())
                pred = pred + draft.d2t[pred]
                hit = (pred == _shift(target_tok, j)) & _shift(mask, 2 + j).bool()
                reached[j] += int(ok.sum())
                ok = ok & hit
                correct_at[j] += int(ok.sum())
                length = length + ok.long()
            total_len += float(length[start].sum())
            chains += int(start.sum())
            rounds += serving_rounds(length[0].tolist(), mask[0].bool().tolist())
    if chains == 0:
        raise ValueError("no trained positions in the held-out samples")
    per_step = [correct_at[j] / reached[j] if reached[j] else 0.0 for j in range(steps)]
    at_least = [sum(n >= j + 2 for n in rounds) / len(rounds) for j in range(steps)] if rounds else None
    return AcceptanceResult(
        total_len / chains,
        per_step,
        chains,
        loss_sum / loss_n if loss_n else None,
        ent_sum / loss_n if loss_n else None,
        sum(rounds) / len(rounds) if rounds else None,
        at_least,
        len(rounds),
    )
