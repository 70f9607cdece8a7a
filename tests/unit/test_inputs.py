"""The recipe's input files checked before anything starts (``plan.inputs``: ``recipe validate
--check-files``, ``doctor RECIPE``, ``launch``): good inputs pass; each mismatch is one line naming the file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from conftest import TEST_SPEC, prepare_corpus

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("inputs")
    return prepare_corpus(root, 6, "--standin-tokenizer")


def _recipe(target: Path, data: Path, **trainer):
    from specforge_kimi.plan.recipes import Recipe

    raw = yaml.safe_load((ROOT / "recipes" / "tiny-k25-tp2-h200x2.yaml").read_text())
    raw["target"].update(
        path=str(target),
        num_layers=TEST_SPEC["layers"],
        hidden_size=TEST_SPEC["hidden"],
        num_attention_heads=TEST_SPEC["heads"],
        aux_layer_ids=[1, 3, 4],
    )
    raw["gpus"]["per_node"] = 1
    raw["trainer"]["draft"].update(
        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=4, draft_vocab_size=256
    )
    raw["trainer"].update(max_length=256, **trainer)
    raw["data"] = {"prompts_path": str(data / "prompts.jsonl"), "vocab_mapping_path": str(data / "vocab_mapping.pt")}
    return Recipe.model_validate(raw)


def _problems(recipe) -> list[str]:
    from specforge_kimi.plan.inputs import check_inputs

    return check_inputs(recipe)


def test_good_inputs_pass(tiny_dir, data):
    assert _problems(_recipe(tiny_dir, data)) == []


def test_missing_files_one_line_each(tmp_path, tiny_dir):
    problems = _problems(_recipe(tmp_path / "no-target", tmp_path / "no-data"))
    assert len(problems) == 3, problems
    assert problems[0].startswith(f"target.path {tmp_path / 'no-target'}")
    assert "data.vocab_mapping_path" in problems[1] and "does not exist" in problems[1]
    assert "data.prompts_path" in problems[2] and "does not exist" in problems[2]
    assert all("\n" not in p for p in problems)


def test_target_disagrees_with_recipe(tmp_path, tiny_dir, data):
    target = tmp_path / "k25"
    shutil.copytree(tiny_dir, target)
    cfg = json.loads((target / "config.json").read_text())
    cfg["text_config"]["max_position_embeddings"] = 300  # 256 + 256 does not fit
    (target / "config.json").write_text(json.dumps(cfg))
    recipe = _recipe(target, data)
    recipe = recipe.model_copy(update={"target": recipe.target.model_copy(update={"num_attention_heads": 16})})
    problems = _problems(recipe)
    assert problems == [
        f"target.num_attention_heads is 16 in the recipe but 8 in {target}/config.json",
        "trainer.max_length 256 + 256 exceeds the target's max_position_embeddings 300: the capture server would "
        "refuse its context length; lower trainer.max_length",
    ]


def test_draft_context_shorter_than_max_length(tiny_dir, data):
    recipe = _recipe(tiny_dir, data)
    draft = recipe.trainer.draft.model_copy(update={"max_position_embeddings": 128})
    recipe = recipe.model_copy(update={"trainer": recipe.trainer.model_copy(update={"draft": draft})})
    assert _problems(recipe) == [
        "trainer.max_length 256 exceeds the draft's max_position_embeddings 128; raise it in trainer.draft or "
        "lower trainer.max_length"
    ]


@pytest.mark.parametrize(
    "row, needle",
    [
        ({"input_ids": [1, 2, 200000], "loss_mask": [0, 1, 1]}, "outside the target's vocabulary of 163840"),
        ({"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}, "was not rendered with K2.5's chat template"),
        ({"input_ids": [1, 2, 3], "loss_mask": [0, 1]}, "has 3 input_ids but 2 loss_mask entries"),
        ({"text": "hello"}, "lacks input_ids and loss_mask lists"),
    ],
)
def test_prompts_not_for_this_target(tmp_path, tiny_dir, data, row, needle):
    own = tmp_path / "data"
    shutil.copytree(data, own)
    lines = (own / "prompts.jsonl").read_text().splitlines()
    (own / "prompts.jsonl").write_text("\n".join([lines[0], json.dumps(row), *lines[1:]]) + "\n")
    problems = _problems(_recipe(tiny_dir, own))
    assert len(problems) == 1 and needle in problems[0] and "line 2" in problems[0], problems


def test_vocab_mapping_for_another_target_or_draft(tmp_path, tiny_dir, data):
    import torch

    recipe = _recipe(tiny_dir, data)
    draft = recipe.trainer.draft.model_copy(update={"draft_vocab_size": 128})
    recipe = recipe.model_copy(update={"trainer": recipe.trainer.model_copy(update={"draft": draft})})
    problems = _problems(recipe)
    assert len(problems) == 1 and "maps 256 draft ids but trainer.draft.draft_vocab_size is 128" in problems[0]
    own = tmp_path / "data"
    shutil.copytree(data, own)
    t2d = torch.zeros(32000, dtype=torch.bool)
    t2d[:256] = True
    torch.save({"d2t": torch.zeros(256, dtype=torch.int64), "t2d": t2d}, own / "vocab_mapping.pt")
    (own / "vocab_mapping.json").unlink()
    problems = _problems(_recipe(tiny_dir, own))
    assert len(problems) == 1 and "covers a vocabulary of 32000 ids" in problems[0], problems


def test_require_inputs_one_error_line_per_problem(tmp_path):
    from specforge_kimi.errors import KimiInputError
    from specforge_kimi.plan.inputs import require_inputs

    with pytest.raises(KimiInputError) as exc:
        require_inputs(_recipe(tmp_path / "x", tmp_path / "y"))
    lines = f"error: {exc.value}".splitlines()
    assert len(lines) == 3 and all(line.startswith("error: ") for line in lines)
