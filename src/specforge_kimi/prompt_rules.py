"""Rule-determined answers to free-form prompts: the tiny target's pretraining for the bench's domains.

Scope: a tiny target pretrained on :mod:`corpus` alone answers the bench's natural-language
``chat``/``math``/``code`` prompts with whatever its weights make of text it never saw. Measured
(tests/gpu/RUNS.md, ninth session): its own entropy along its greedy answers is 0.89 nats per token
on the bench's math prompts against 0.33-0.49 elsewhere, and the draft's acceptance in SGLang
follows it (math 1.71, chat 2.06, code 2.80). Acceptance on such a target measures the target's
confusion, not the pipeline. This module gives it a rule for any prompt, so that its answers there
are a function of the prompt a draft can learn, as the corpus's are for its own questions:

    the first :data:`MAX_WORDS` words of the prompt (runs of letters and digits), one per line,
    numbered: ``1. What`` / ``2. are`` / ...; reasoning (when the conversation has it):
    :data:`REASONING`.

The rule copies; it is no model of what K2.5 would answer, and the acceptance it yields says how
well the pipeline trains a draft to follow a target, not what a K2.5 draft will accept. Prompts come
from :mod:`prompt_mix` (which never yields a bench prompt); :func:`bench_conversations` applies the
rule to the bench's own prompts, for held-out numbers only.
"""

from __future__ import annotations

import re
from typing import Iterator

WORD = re.compile(r"[A-Za-z0-9]+")
MAX_WORDS = 12
REASONING = "list the first words of the question, one per line"
#: seed of :func:`prompt_mix.prompts` for pretraining (the data stage's mix uses seed 0)
PRETRAIN_SEED = 3


def answer(prompt: str) -> str:
    """The rule's answer to ``prompt``; a prompt without a letter or digit has none (``ValueError``)."""
    words = WORD.findall(prompt)[:MAX_WORDS]
    if not words:
        raise ValueError(f"prompt has no words for the rule: {prompt!r}")
    return "\n".join(f"{i}. {w}" for i, w in enumerate(words, 1))


def _conversation(cid: str, prompt: str, thinking: bool) -> dict:
    assistant = {"role": "assistant", "content": answer(prompt)}
    if thinking:
        assistant["reasoning_content"] = REASONING
    return {"id": cid, "messages": [{"role": "user", "content": prompt}, assistant]}


def conversations(n: int, seed: int = PRETRAIN_SEED, *, thinking_every: int = 2) -> Iterator[dict]:
    """``n`` prompt-mix prompts answered by the rule; every ``thinking_every``-th with reasoning (as
    :func:`corpus.conversations`)."""
    from specforge_kimi import prompt_mix

    for i, (domain, prompt) in enumerate(prompt_mix.prompts(n, seed=seed)):
        yield _conversation(f"rule-{domain}-{seed}-{i}", prompt, bool(thinking_every) and i % thinking_every == 0)


def bench_conversations() -> list[dict]:
    """The bench's own chat/math/code prompts answered by the rule, with reasoning (the bench asks with
    thinking on): held-out rows for the target's numbers, never trained on."""
    from specforge_kimi.bench import builtin_prompt_set
    from specforge_kimi.prompt_mix import DOMAINS

    return [_conversation(p.id, next(m.content for m in p.messages if m.role == "user"), True)
            for name in DOMAINS for p in builtin_prompt_set(name).prompts]
