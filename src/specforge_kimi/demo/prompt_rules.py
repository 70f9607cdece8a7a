"""Rule-determined answers to free-form prompts: the tiny target's pretraining for the bench's domains.

Scope: a tiny target pretrained on :mod:`corpus` alone answers the bench's natural-language
``chat``/``math``/``code`` prompts with whatever its weights make of text it never saw. Measured
(archive/gpu-runs/RUNS.md, the deep-taps run): its own entropy along its greedy answers is highest on the
bench's math prompts, and the draft's acceptance in SGLang follows it, lowest on math. Acceptance on such a
target measures the target's confusion, not the pipeline. This module gives it a rule for any prompt, so
that its answers there are a function of the prompt a draft can learn, as the corpus's are for its own
questions. Two rules (:data:`RULES`):

``echo`` (the default)
    the prompt restated: its text with runs of whitespace made one space, cut at
    :data:`ECHO_CHARS` characters; reasoning (when the conversation has it): ``restate the question``.
``words`` (the first prompt-rule target)
    the first :data:`MAX_WORDS` words of the prompt (runs of letters and digits), one per line,
    numbered: ``1. What`` / ``2. are`` / ...; reasoning: ``list the first words of the question, one
    per line``. Measured (archive/gpu-runs/RUNS.md, the prompt-rule target): the target followed it on most
    but not all answer tokens of the bench's own prompts, and its own text was not more predictable than without
    it. Finding the next
    word is a two-step lookup (which word came last, then the one after it in the prompt); ``echo`` is
    a contiguous copy, the one-step lookup a transformer's induction heads make.

Both rules copy; neither is a model of what K2.5 would answer, and the acceptance they yield says how
well the pipeline trains a draft to follow a target, not what a K2.5 draft will accept. Prompts come
from :mod:`prompt_mix` (which never yields a bench prompt); :func:`bench_conversations` applies a rule
to the bench's own prompts, for held-out numbers only.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

WORD = re.compile(r"[A-Za-z0-9]+")
MAX_WORDS = 12
ECHO_CHARS = 80
#: rule name -> (reasoning sentence, one-line description for pretrain.json)
RULES = {
    "echo": (
        "restate the question",
        f"the prompt restated (whitespace runs made one space, cut at {ECHO_CHARS} characters)",
    ),
    "words": (
        "list the first words of the question, one per line",
        f"the prompt's first {MAX_WORDS} words, one per numbered line",
    ),
}
DEFAULT_RULE = "echo"
#: seed of :func:`prompt_mix.prompts` for pretraining (the data stage's mix uses seed 0)
PRETRAIN_SEED = 3


def _check(rule: str) -> None:
    if rule not in RULES:
        raise ValueError(f"unknown prompt rule {rule!r}; choose one of {sorted(RULES)}")


def answer(prompt: str, rule: str = DEFAULT_RULE) -> str:
    """The ``rule``'s answer to ``prompt``; a prompt without a letter or digit has none (``ValueError``)."""
    _check(rule)
    if not WORD.search(prompt):
        raise ValueError(f"prompt has no words for the rule: {prompt!r}")
    if rule == "echo":
        return " ".join(prompt.split())[:ECHO_CHARS].rstrip()
    words = WORD.findall(prompt)[:MAX_WORDS]
    return "\n".join(f"{i}. {w}" for i, w in enumerate(words, 1))


def reasoning(rule: str) -> str:
    """The fixed reasoning sentence of ``rule`` (conversations with reasoning carry it)."""
    _check(rule)
    return RULES[rule][0]


def _conversation(cid: str, prompt: str, thinking: bool, rule: str) -> dict:
    assistant = {"role": "assistant", "content": answer(prompt, rule)}
    if thinking:
        assistant["reasoning_content"] = reasoning(rule)
    return {"id": cid, "messages": [{"role": "user", "content": prompt}, assistant]}


def conversations(
    n: int, seed: int = PRETRAIN_SEED, *, thinking_every: int = 2, rule: str = DEFAULT_RULE
) -> Iterator[dict]:
    """``n`` prompt-mix prompts answered by ``rule``; every ``thinking_every``-th with reasoning (as
    :func:`corpus.conversations`)."""
    from specforge_kimi.data import prompt_mix

    _check(rule)
    for i, (domain, prompt) in enumerate(prompt_mix.prompts(n, seed=seed)):
        yield _conversation(f"rule-{domain}-{seed}-{i}", prompt, bool(thinking_every) and i % thinking_every == 0, rule)


def bench_conversations(rule: str = DEFAULT_RULE) -> list[dict]:
    """The bench's own chat/math/code prompts answered by ``rule``, with reasoning (the bench asks with
    thinking on): held-out rows for the target's numbers, never trained on."""
    from specforge_kimi.data.prompt_mix import DOMAINS
    from specforge_kimi.evaluate.bench import builtin_prompt_set

    _check(rule)
    return [
        _conversation(p.id, next(m.content for m in p.messages if m.role == "user"), True, rule)
        for name in DOMAINS
        for p in builtin_prompt_set(name).prompts
    ]
