"""Training prompts in the style of the bench's chat, math and code sets, never one of the bench's prompts.

Scope: a draft learns how the target continues the contexts it is trained on. Trained only on the
structured corpus's prompts, the tiny target's draft accepted clearly less on the bench's ``chat``, ``math``
and ``code`` sets than on its ``structured`` one (archive/gpu-runs/RUNS.md, the draft-logits-parity run): those
prompts are outside what it saw. A user trains on prompts like their traffic; this module is that
for the project's own prompt sets. It writes user prompts from templates and slot lists (written
for this project, seeded, deterministic) and drops any prompt whose normalized text equals one in
``specforge_kimi/data/prompts/*.jsonl``, so the bench's prompts stay held out.

Records are OpenAI messages with an empty assistant turn for ``specforge-kimi regenerate`` to fill
with the target's own answer (run it with ``--thinking on``: the bench asks these sets with
thinking on). :func:`prompts` yields the bare strings for code that encodes them itself.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable, Iterator
from importlib import resources

DOMAINS = ("chat", "math", "code")

_GOALS = [
    "sleep better on a noisy street",
    "save money on groceries",
    "keep houseplants alive",
    "stay focused when working from home",
    "prepare for a long flight",
    "learn to cook on a budget",
    "make a small kitchen tidier",
    "get back into reading",
    "drink more water during the day",
    "reduce screen time in the evening",
    "train for a first 10 km race",
    "make new friends in a new city",
    "keep a journal every day",
]
_CONCEPTS = [
    "photosynthesis",
    "compound interest",
    "the greenhouse effect",
    "how vaccines work",
    "supply and demand",
    "plate tectonics",
    "the phases of the moon",
    "how a rainbow forms",
    "what a carbon footprint is",
    "how tides work",
    "why leaves change colour in autumn",
    "how bees make honey",
    "what an eclipse is",
]
_AUDIENCES = ["a seven-year-old", "a teenager", "a busy parent", "a retired engineer", "someone new to the topic"]
_KINDS = ["poem", "story", "limerick", "speech", "letter", "dialogue", "diary entry"]
_TOPICS = [
    "a cat who learns to swim",
    "a city at dawn",
    "an old bicycle",
    "a lost umbrella",
    "the last day of summer",
    "a robot gardener",
    "a train journey through the mountains",
    "a quiet library",
    "a kite on a windy beach",
]
_OCCASIONS = [
    "a rainy weekend with kids",
    "a retirement party",
    "a team-building afternoon",
    "a picnic in the park",
    "a friend's graduation",
    "a family reunion",
    "a first date",
    "a school science fair",
]
_TASKS = [
    "ask my manager for a day off",
    "write a cover letter",
    "start a vegetable garden",
    "choose a laptop",
    "plan a road trip",
    "negotiate the price of a used car",
    "organise a small wedding",
    "clean a cast-iron pan",
    "prepare a presentation in one evening",
    "say no to extra work politely",
]
_SUBJECTS = [
    "the history of the printing press",
    "the life of Marie Curie",
    "the story of the Odyssey",
    "the causes of the First World War",
    "how the internet began",
    "the invention of the telephone",
    "the rise of the Roman Empire",
    "the plot of Pride and Prejudice",
]
_PAIRS = [
    ("tea", "coffee"),
    ("a lake", "a sea"),
    ("a crocodile", "an alligator"),
    ("a fruit", "a vegetable"),
    ("renting a car", "taking the train"),
    ("a credit card", "a debit card"),
    ("a cold", "the flu"),
    ("an ebook", "a paper book"),
    ("a city break", "a beach holiday"),
    ("weather", "seasons"),
]
_WHO = ["a student", "a family of four", "a frequent traveller", "someone on a tight budget", "a small business"]

_LANGS = ["Python", "JavaScript", "Go", "Rust", "C", "Java", "TypeScript", "C++"]
_CODE_TASKS = [
    "counts the vowels in a string",
    "returns the second largest number in a list",
    "checks whether two strings are anagrams",
    "flattens a nested list",
    "removes duplicates from a list while keeping the order",
    "converts Celsius to Fahrenheit",
    "finds the most common word in a text",
    "checks whether a year is a leap year",
    "returns the n-th prime number",
    "capitalizes the first letter of every word",
    "computes the running average of a list of numbers",
    "validates an email address with a simple rule",
    "splits a list into chunks of size k",
    "returns the intersection of two lists",
]
_ALGOS = [
    "merge sort",
    "insertion sort",
    "breadth-first search on a graph",
    "depth-first search on a graph",
    "a queue using two stacks",
    "a binary search tree with insert and search",
    "Dijkstra's shortest path",
    "the sieve of Eratosthenes",
    "a min-heap",
    "run-length encoding",
]
_CODE_PAIRS = [
    ("a set", "a list"),
    ("an interface", "an abstract class"),
    ("== and is", "equality and identity"),
    ("a shallow copy", "a deep copy"),
    ("a stack", "a queue"),
    ("synchronous and asynchronous code", "threads"),
    ("pass by value", "pass by reference"),
    ("a compiler", "an interpreter"),
]
_TOOLS = [
    ("undo the last commit", "git"),
    ("list the largest files in a directory", "bash"),
    ("group rows and sum a column", "pandas"),
    ("join two tables", "SQL"),
    ("read a JSON file", "Python"),
    ("sort a dictionary by value", "Python"),
    ("find which process uses a port", "Linux"),
    ("parse command-line arguments", "Python"),
]


def _chat(rng: random.Random) -> str:
    forms: list[Callable[[], str]] = [
        lambda: f"What are {rng.choice(['three', 'four', 'five'])} practical ways to {rng.choice(_GOALS)}?",
        lambda: f"Explain {rng.choice(_CONCEPTS)} to {rng.choice(_AUDIENCES)}.",
        lambda: f"Write a short {rng.choice(_KINDS)} about {rng.choice(_TOPICS)}.",
        lambda: f"Give me {rng.choice(['three', 'five', 'six'])} ideas for {rng.choice(_OCCASIONS)}.",
        lambda: f"How do I {rng.choice(_TASKS)}?",
        lambda: f"Summarise {rng.choice(_SUBJECTS)} in {rng.choice(['three', 'four', 'five'])} sentences.",
        lambda: "Compare {} and {} for {}.".format(*rng.choice(_PAIRS), rng.choice(_WHO)),
        lambda: "What is the difference between {} and {}?".format(*rng.choice(_PAIRS)),
    ]
    return rng.choice(forms)()


def _math(rng: random.Random) -> str:
    r = rng.randint
    forms: list[Callable[[], str]] = [
        lambda: (
            f"A {rng.choice(['bus', 'cyclist', 'ship', 'runner'])} travels {r(20, 400)} km in {r(2, 9)} hours. "
            "What is its average speed in km/h?"
        ),
        lambda: f"Solve for x: {r(2, 9)}x + {r(1, 30)} = {r(31, 120)}.",
        lambda: f"What is {rng.choice([5, 10, 12, 20, 25, 30, 40])}% of {r(2, 90) * 10}?",
        lambda: f"Find the derivative of f(x) = {r(2, 7)}x^{r(2, 5)} + {r(1, 9)}x - {r(1, 20)}.",
        lambda: f"What is the sum of the first {r(10, 90)} positive integers?",
        lambda: f"Find the greatest common divisor of {r(12, 300)} and {r(12, 300)}.",
        lambda: f"How many ways can {r(3, 8)} books be arranged on a shelf?",
        lambda: f"Is {r(101, 997)} a prime number? Show your reasoning.",
        lambda: f"A rectangle is {r(3, 30)} cm by {r(3, 30)} cm. What are its perimeter and area?",
        lambda: f"What is the remainder when {r(2, 9)}^{r(5, 30)} is divided by {r(3, 13)}?",
        lambda: f"A price of ${r(20, 500)} rises by {r(2, 30)}%. What is the new price?",
        lambda: f"Find the mean of the numbers {', '.join(str(r(1, 60)) for _ in range(r(4, 7)))}.",
    ]
    return rng.choice(forms)()


def _code(rng: random.Random) -> str:
    forms: list[Callable[[], str]] = [
        lambda: f"Write a {rng.choice(_LANGS)} function that {rng.choice(_CODE_TASKS)}.",
        lambda: f"Implement {rng.choice(_ALGOS)} in {rng.choice(_LANGS)}.",
        lambda: "Explain the difference between {} and {}, with examples.".format(*rng.choice(_CODE_PAIRS)),
        lambda: f"Write pytest unit tests for a function that {rng.choice(_CODE_TASKS)}.",
        lambda: "How do I {} in {}?".format(*rng.choice(_TOOLS)),
        lambda: f"What is the time complexity of {rng.choice(_ALGOS)}? Explain briefly.",
    ]
    return rng.choice(forms)()


_SUFFIXES = {
    "chat": ["", " Keep it short.", " Use a friendly tone.", " Answer as a list.", " Explain your reasoning."],
    "code": ["", " Add comments.", " Include an example call.", " Keep it short.", " Mention edge cases."],
}


def _with_suffix(domain: str, make: Callable[[random.Random], str]) -> Callable[[random.Random], str]:
    return lambda rng: make(rng) + rng.choice(_SUFFIXES[domain])


_MAKERS = {"chat": _with_suffix("chat", _chat), "math": _math, "code": _with_suffix("code", _code)}


def normalize(text: str) -> str:
    """Lower case, punctuation dropped, whitespace collapsed: the form two prompts are compared in."""
    return " ".join(re.sub(r"[^0-9a-z]+", " ", text.lower()).split())


def bench_prompts() -> set[str]:
    """Every prompt of the shipped chat/math/code sets, normalized."""
    out = set()
    for name in DOMAINS:
        text = resources.files("specforge_kimi.data").joinpath("prompts", f"{name}.jsonl").read_text()
        for line in text.splitlines():
            if line.strip():
                for m in json.loads(line)["messages"]:
                    if m.get("role") == "user":
                        out.add(normalize(m["content"]))
    return out


def prompts(n: int, seed: int = 0) -> Iterator[tuple[str, str]]:
    """``n`` distinct ``(domain, prompt)`` pairs, domains in turn, none equal to a bench prompt."""
    if n < 0:
        raise ValueError(f"n must be >= 0, not {n}")
    rng = random.Random(seed)
    held_out, seen = bench_prompts(), set()
    produced = misses = 0
    while produced < n:
        domain = DOMAINS[produced % len(DOMAINS)]
        text = _MAKERS[domain](rng)
        key = normalize(text)
        if key in held_out or key in seen:
            misses += 1
            if misses > 5000:  # the domain's templates are (nearly) exhausted
                raise ValueError(f"only {produced} distinct prompts from the templates; ask for fewer than {n}")
            continue
        misses = 0
        seen.add(key)
        produced += 1
        yield domain, text


def records(n: int, seed: int = 0) -> Iterator[dict]:
    """:func:`prompts` as conversations for ``specforge-kimi regenerate`` (empty assistant turn)."""
    for i, (domain, text) in enumerate(prompts(n, seed)):
        yield {
            "id": f"mix-{domain}-{i:05d}",
            "source": f"prompt_mix/{domain}",
            "messages": [{"role": "user", "content": text}, {"role": "assistant", "content": ""}],
        }
