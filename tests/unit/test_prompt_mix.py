"""prompt_mix: deterministic chat/math/code training prompts that never repeat a bench prompt."""

import json
from collections import Counter

import pytest

from specforge_kimi.data import prompt_mix
from specforge_kimi.evaluate.bench import builtin_prompt_set


def test_deterministic_balanced_distinct():
    a = list(prompt_mix.prompts(900, seed=0))
    assert a == list(prompt_mix.prompts(900, seed=0))
    assert a != list(prompt_mix.prompts(900, seed=1))
    assert Counter(d for d, _ in a) == {"chat": 300, "math": 300, "code": 300}
    assert len({prompt_mix.normalize(t) for _, t in a}) == 900
    # a longer stream starts with the shorter one: training and held-out prompts come from one stream
    assert list(prompt_mix.prompts(948, seed=0))[:900] == a


def test_never_a_bench_prompt():
    bench = {
        prompt_mix.normalize(p.messages[0].content)
        for name in prompt_mix.DOMAINS
        for p in builtin_prompt_set(name).prompts
    }
    assert len(bench) == 96 and bench == prompt_mix.bench_prompts()
    assert not bench & {prompt_mix.normalize(t) for _, t in prompt_mix.prompts(2400, seed=0)}


def test_bench_prompt_is_dropped(monkeypatch):
    """A template output equal to a bench prompt (up to case and punctuation) is skipped."""
    first = next(prompt_mix.prompts(1, seed=3))[1]
    monkeypatch.setattr(prompt_mix, "bench_prompts", lambda: {prompt_mix.normalize(first.upper() + "!!")})
    assert first not in [t for _, t in prompt_mix.prompts(30, seed=3)]


def test_records_for_regenerate():
    from specforge_kimi.data.conversation import conversation_from_record

    recs = list(prompt_mix.records(4, seed=0))
    assert [r["id"] for r in recs] == ["mix-chat-00000", "mix-math-00001", "mix-code-00002", "mix-chat-00003"]
    for r in recs:
        json.dumps(r)
        assert list(conversation_from_record(r).assistant_indices) == [1]


def test_bad_counts():
    with pytest.raises(ValueError, match="n must be >= 0"):
        list(prompt_mix.prompts(-1))
    with pytest.raises(ValueError, match="distinct prompts from the templates"):
        list(prompt_mix.prompts(100_000))
