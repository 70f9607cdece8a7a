"""A synthetic, structured conversation corpus for tiny targets (demo and bench).

Scope: deterministic OpenAI-format conversations (``messages`` with ``reasoning_content``) whose
answers follow from the question by simple rules -- counting, spelling, reversing, repeating,
small multiplication tables, colour cycles. A tiny K2.5 pretrained on them for a minute makes
predictions with structure, so a draft trained against it has something to learn; a
random-weight target's next-token choices are near-arbitrary. Nothing here is meant to teach
language: the point is a target whose outputs a draft can predict.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

WORDS = [
    "apple",
    "river",
    "stone",
    "cloud",
    "tiger",
    "maple",
    "piano",
    "lemon",
    "comet",
    "field",
    "ocean",
    "ember",
    "grape",
    "honey",
    "input",
    "joker",
    "koala",
    "laser",
    "mango",
    "night",
]
COLOURS = ["red", "green", "blue", "yellow", "purple", "orange"]

#: Seeds of the corpus: ``tiny --pretrain`` trains on ``TRAIN_SEED`` conversations; the bench's
#: ``structured`` prompt set and the pretraining's held-out loss use ``HELDOUT_SEED`` ones.
TRAIN_SEED = 1
HELDOUT_SEED = 20_000


def _count(rng: random.Random) -> tuple[str, str, str]:
    a = rng.randint(1, 60)
    b = a + rng.randint(4, 12)
    return (
        f"Count from {a} to {b}.",
        f"count up by one from {a} until {b}",
        " ".join(str(i) for i in range(a, b + 1)) + ".",
    )


def _spell(rng: random.Random) -> tuple[str, str, str]:
    w = rng.choice(WORDS)
    return (f"Spell the word {w}.", f"the letters of {w} in order", "-".join(w) + ".")


def _reverse(rng: random.Random) -> tuple[str, str, str]:
    w = rng.choice(WORDS)
    return (f"Reverse the word {w}.", f"read {w} from the end", w[::-1] + ".")


def _repeat(rng: random.Random) -> tuple[str, str, str]:
    w, n = rng.choice(WORDS), rng.randint(3, 6)
    return (f"Repeat {w} {n} times.", f"write {w} {n} times", " ".join([w] * n) + ".")


def _table(rng: random.Random) -> tuple[str, str, str]:
    k = rng.randint(2, 9)
    return (
        f"Multiplication table of {k}.",
        f"multiply {k} by 1 to 5",
        "; ".join(f"{k} x {i} = {k * i}" for i in range(1, 6)) + ".",
    )


def _colours(rng: random.Random) -> tuple[str, str, str]:
    start, n = rng.randrange(len(COLOURS)), rng.randint(6, 10)
    seq = [COLOURS[(start + i) % len(COLOURS)] for i in range(n)]
    return (
        f"Continue the colour cycle from {seq[0]}.",
        "cycle red green blue yellow purple orange",
        ", ".join(seq) + ".",
    )


TASKS = (_count, _spell, _reverse, _repeat, _table, _colours)


def conversations(n: int, seed: int = 0, *, thinking_every: int = 2) -> Iterator[dict]:
    """``n`` conversations; every ``thinking_every``-th one answers in instant mode (no reasoning)."""
    rng = random.Random(seed)
    for i in range(n):
        question, reasoning, answer = rng.choice(TASKS)(rng)
        assistant = {"role": "assistant", "content": answer}
        if thinking_every and i % thinking_every == 0:
            assistant["reasoning_content"] = reasoning
        messages = [{"role": "user", "content": question}, assistant]
        if rng.random() < 0.3:
            messages.insert(0, {"role": "system", "content": "You answer with the pattern only."})
        yield {"id": f"synthetic-{seed}-{i}", "messages": messages}
