"""``eval-draft`` on CPU: simulated acceptance and held-out loss of an untrained draft, on corpus
conversations and on a held-out conversations file (what a regenerated run is measured on)."""

import json

import pytest
from conftest import prepare_corpus

from specforge_kimi.errors import KimiInputError


@pytest.fixture(scope="module")
def setup(tiny_dir, tmp_path_factory):
    from specforge_kimi.demo.pipeline import _draft_config

    root = tmp_path_factory.mktemp("eval")
    prepare_corpus(root, 40, "--tokenizer", str(tiny_dir))
    (root / "draft.json").write_text(json.dumps(_draft_config(64, 256, [2, 3, 4])))
    return tiny_dir, root


def test_untrained_draft_on_corpus_and_on_a_file(setup):
    from specforge_kimi.data import corpus
    from specforge_kimi.demo.draft_eval import evaluate

    target, root = setup
    kw = dict(
        target_dir=str(target),
        draft_config=str(root / "draft.json"),
        vocab_mapping=str(root / "data" / "vocab_mapping.pt"),
        aux_specforge_ids=[1, 2, 3],
        checkpoints=[],
        heldout=3,
    )
    on_corpus = evaluate(**kw)
    # the same conversations from a file give the same numbers
    with open(root / "heldout.jsonl", "w") as f:
        for row in corpus.conversations(3, seed=20000):
            f.write(json.dumps(row) + "\n")
    on_file = evaluate(**kw, heldout_file=str(root / "heldout.jsonl"))
    a, b = on_corpus["results"][0], on_file["results"][0]
    assert a["checkpoint"] == "untrained" and 1.0 <= a["mean_acceptance_length"] <= 4.0
    assert a["heldout_loss"] == pytest.approx(b["heldout_loss"], rel=1e-5)
    assert a["mean_acceptance_length"] == pytest.approx(b["mean_acceptance_length"])
    assert on_file["heldout_file"] and on_file["heldout_seed"] is None
    # decode rounds: one or more per conversation; per-position shares fall with the position
    assert a["serving_rounds"] >= 3 and 1.0 <= a["serving_acceptance_length"] <= 4.0
    assert a["serving_acceptance_length"] == pytest.approx(1 + sum(a["serving_at_least"]))
    assert all(x >= y for x, y in zip(a["serving_at_least"], a["serving_at_least"][1:], strict=False))


def test_heldout_file_errors(setup, tmp_path):
    from specforge_kimi.demo.draft_eval import heldout_rows

    with pytest.raises(KimiInputError, match="does not exist"):
        heldout_rows(3, conversations_file=str(tmp_path / "nope.jsonl"))
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    with pytest.raises(KimiInputError, match="bad.jsonl:1: not JSON"):
        heldout_rows(3, conversations_file=str(tmp_path / "bad.jsonl"))
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(KimiInputError, match="holds no conversation"):
        heldout_rows(3, conversations_file=str(tmp_path / "empty.jsonl"))


def test_groups_by_source(setup):
    """A held-out file mixing corpus conversations and prompt-mix ones (``source`` key) is also
    evaluated per group; each group's numbers equal a run on that group alone."""
    from specforge_kimi.data import corpus
    from specforge_kimi.demo.draft_eval import evaluate

    target, root = setup
    kw = dict(
        target_dir=str(target),
        draft_config=str(root / "draft.json"),
        vocab_mapping=str(root / "data" / "vocab_mapping.pt"),
        aux_specforge_ids=[1, 2, 3],
        checkpoints=[],
    )
    chat = [
        {
            "source": "prompt_mix/chat",
            "messages": [
                {"role": "user", "content": f"Tell me about {w}."},
                {"role": "assistant", "content": f"{w} is a word.", "reasoning_content": "short"},
            ],
        }
        for w in ("rain", "maple")
    ]
    conv = list(corpus.conversations(2, seed=20000))
    (root / "mixed.jsonl").write_text("".join(json.dumps(r) + "\n" for r in conv + chat))
    (root / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chat))
    res = evaluate(**kw, heldout=4, heldout_file=str(root / "mixed.jsonl"))["results"][0]
    assert set(res["by_group"]) == {"corpus", "prompt_mix/chat"}
    assert res["by_group"]["corpus"]["samples"] == 2 and res["by_group"]["prompt_mix/chat"]["samples"] == 2
    alone = evaluate(**kw, heldout=2, heldout_file=str(root / "chat.jsonl"))["results"][0]
    assert "by_group" not in alone
    assert res["by_group"]["prompt_mix/chat"]["heldout_loss"] == pytest.approx(alone["heldout_loss"], rel=1e-5)
    assert res["by_group"]["prompt_mix/chat"]["serving_acceptance_length"] == pytest.approx(
        alone["serving_acceptance_length"]
    )
    assert res["by_group"]["prompt_mix/chat"]["teacher_entropy"] == pytest.approx(alone["teacher_entropy"], rel=1e-5)
