"""The tiny target's rule for free-form prompts (``specforge_kimi.demo.prompt_rules``): the answer it
defines, the conversations it makes from the prompt mix, and its held-out rows from the bench."""

import pytest

from specforge_kimi.data import prompt_mix
from specforge_kimi.demo import prompt_rules


def test_answer_numbers_the_first_words_one_per_line():
    assert prompt_rules.answer("Solve for x: 3x + 7 = 25.", "words") == "1. Solve\n2. for\n3. x\n4. 3x\n5. 7\n6. 25"
    long = " ".join(f"w{i}" for i in range(30))
    lines = prompt_rules.answer(long, "words").split("\n")
    assert (
        len(lines) == prompt_rules.MAX_WORDS and lines[-1] == f"{prompt_rules.MAX_WORDS}. w{prompt_rules.MAX_WORDS - 1}"
    )


def test_echo_restates_the_prompt_cut_at_its_length():
    assert prompt_rules.answer("Solve for x:\n  3x + 7 = 25.") == "Solve for x: 3x + 7 = 25."  # the default rule
    long = "word " * 40
    out = prompt_rules.answer(long, "echo")
    assert len(out) <= prompt_rules.ECHO_CHARS and long.startswith(out) and not out.endswith(" ")


@pytest.mark.parametrize("rule", sorted(prompt_rules.RULES))
def test_a_prompt_without_words_has_no_answer(rule):
    with pytest.raises(ValueError, match="no words"):
        prompt_rules.answer("?! ... --", rule)


def test_an_unknown_rule_is_refused():
    with pytest.raises(ValueError, match="unknown prompt rule 'shout'"):
        prompt_rules.answer("hello", "shout")
    with pytest.raises(ValueError, match="unknown prompt rule"):
        list(prompt_rules.conversations(2, rule="shout"))


@pytest.mark.parametrize("rule", sorted(prompt_rules.RULES))
def test_conversations_are_the_prompt_mix_answered_by_the_rule(rule):
    convs = list(prompt_rules.conversations(40, seed=5, rule=rule))
    prompts = [p for _, p in prompt_mix.prompts(40, seed=5)]
    assert [c["messages"][0]["content"] for c in convs] == prompts
    assert list(prompt_rules.conversations(40, seed=5, rule=rule)) == convs  # deterministic
    for i, c in enumerate(convs):
        user, assistant = c["messages"]
        assert assistant["content"] == prompt_rules.answer(user["content"], rule)
        assert assistant.get("reasoning_content", prompt_rules.reasoning(rule)) == prompt_rules.reasoning(rule)
        assert ("reasoning_content" in assistant) == (i % 2 == 0)
    bench = prompt_mix.bench_prompts()
    assert not any(prompt_mix.normalize(p) in bench for p in prompts)


@pytest.mark.parametrize("rule", sorted(prompt_rules.RULES))
def test_bench_conversations_are_the_bench_prompts_with_reasoning(rule):
    rows = prompt_rules.bench_conversations(rule)
    assert len(rows) == 96 and {r["id"].split("-")[0] for r in rows} == {"chat", "math", "code"}
    bench = prompt_mix.bench_prompts()
    for r in rows:
        user, assistant = r["messages"]
        assert prompt_mix.normalize(user["content"]) in bench
        assert assistant["reasoning_content"] == prompt_rules.reasoning(rule)
        assert assistant["content"] == prompt_rules.answer(user["content"], rule)
