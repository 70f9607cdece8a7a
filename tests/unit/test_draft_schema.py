"""The typed ``trainer.draft`` (``plan.draft_config``): generated draft sections of each family, valid ones accepted and
rendered exactly as written, each broken one refused in one line naming the recipe and the field."""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path

import pytest
import yaml

from specforge_kimi.errors import KimiInputError
from specforge_kimi.plan.draft_config import DRAFTS, validate_draft
from specforge_kimi.plan.recipes import Recipe, read_recipe

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
BASE = {"eagle3": "tiny-k25-tp1-h200.yaml", "dflash": "tiny-k25-tp1-h200-dflash.yaml"}
BASE["dspark"] = BASE["dflash"]
#: optional fields a generated draft may carry, with a valid value drawn for each
OPTIONAL = {
    "architectures": None,  # the family's own, below
    "model_type": lambda g: g.choice(["llama", "qwen3", "kimi_k2"]),
    "hidden_act": lambda g: "silu",
    "rms_norm_eps": lambda g: g.choice([1e-5, 1e-6, 1]),
    "max_position_embeddings": lambda g: g.choice([4096, 262144]),
    "rope_theta": lambda g: g.choice([10000.0, 50000, 1e6]),
    "attention_bias": lambda g: g.random() < 0.5,
    "bos_token_id": lambda g: 163584,
    "eos_token_id": lambda g: g.choice([163585, [163585, 163586]]),
    "pad_token_id": lambda g: 163839,
    "tie_word_embeddings": lambda g: False,
    "torch_dtype": lambda g: "bfloat16",
    "num_key_value_heads": lambda g: 8,
    "head_dim": lambda g: 64,
}
ARCH = {"eagle3": "LlamaForCausalLMEagle3", "dflash": "DFlashDraftModel", "dspark": "DSparkDraftModel"}


def _raw(family: str) -> dict:
    raw = yaml.safe_load((RECIPES / BASE[family]).read_text())
    if family == "dspark":
        raw["trainer"].update(family="dspark", dspark={"ce": 0.1, "l1": 0.9, "confidence": 1.0})
    return raw


def gen_draft(g: random.Random, family: str) -> dict:
    """A valid ``family`` draft for the tiny target (its width, vocabulary, layers), keys in a random order."""
    base = _raw(family)["trainer"]["draft"]
    d = {k: base[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")}
    d["intermediate_size"] = g.choice([256, 1024, 2048])
    if family == "eagle3":
        d["draft_vocab_size"] = 256
        if g.random() < 0.5:
            d["num_hidden_layers"] = 1
        if g.random() < 0.5:
            d["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [1, 3, 6], "use_aux_hidden_state": True}
    else:
        d.update({k: base[k] for k in ("block_size", "num_target_layers", "head_dim")})
        n = g.randint(1, 4)
        d["num_hidden_layers"] = n
        if g.random() < 0.5:
            d["layer_types"] = ["full_attention"] * n
        d["num_key_value_heads"] = 4 if family == "dspark" else g.choice([4, 8])
        dc = dict(base["dflash_config"])
        if family == "dspark" and g.random() < 0.5:
            dc.update(markov_rank=g.choice([0, 16]), enable_confidence_head=True, confidence_head_with_markov=True)
        d["dflash_config"] = dict(g.sample(sorted(dc.items()), len(dc)))
    for key, value in OPTIONAL.items():
        if key not in d and g.random() < 0.5:
            d[key] = [ARCH[family]] if value is None else value(g)
    return dict(g.sample(list(d.items()), len(d)))


def _recipe_file(tmp_path: Path, family: str, draft: dict, name: str = "r.yaml") -> Path:
    raw = _raw(family)
    raw["trainer"]["draft"] = draft
    path = tmp_path / name
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


@pytest.mark.parametrize("family", sorted(DRAFTS))
def test_generated_valid_drafts_are_accepted_and_render_as_written(tmp_path, family):
    """Each generated draft passes the whole recipe's schema and its config is the section itself, keys in the
    recipe's order, ints and floats as written (what ``draft_config.json`` gets); a few go through the plan's
    render too."""
    from specforge_kimi.plan.run_plan import compile_plan

    g = random.Random(f"valid-{family}")
    for i in range(120):
        draft = gen_draft(g, family)
        raw = _raw(family)
        raw["trainer"]["draft"] = copy.deepcopy(draft)
        recipe = Recipe.model_validate(raw)
        assert type(recipe.trainer.draft) is DRAFTS[family]
        assert json.dumps(recipe.trainer.draft.config(), indent=2) == json.dumps(draft, indent=2), draft
        if i < 4:
            plan = compile_plan(_recipe_file(tmp_path, family, draft), rendered_dir=tmp_path / f"out{i}")
            plan.write()
            assert (tmp_path / f"out{i}" / "draft_config.json").read_text() == json.dumps(draft, indent=2)


#: (field, bad value, what the message says): each breaks one field of any family's draft
BAD_ANY = [
    ("hiden_size", 512, "Extra inputs are not permitted"),
    ("hidden_size", "512", "valid integer"),
    ("hidden_size", 512.0, "valid integer"),
    ("num_attention_heads", True, "valid integer"),
    ("intermediate_size", 0, "greater than 0"),
    ("rope_theta", "high", "Input should be"),
    ("attention_bias", 1, "valid boolean"),
    ("num_hidden_layers", 0, "Input should be"),
    ("num_hidden_layers", -2, "Input should be"),
    ("max_position_embeddings", -1, "greater than 0"),
    ("pad_token_id", -1, "greater than or equal to 0"),
    ("architectures", ["MedusaModel"], "drafts are"),
]
BAD_BLOCK = [
    ("block_size", 1, "greater than or equal to 2"),
    ("block_size", 0, "greater than or equal to 2"),
    ("block_size", "8", "valid integer"),
    ("draft_vocab_size", 256, "eagle3 drafts only, not for trainer.family"),
    ("eagle_config", {}, "eagle3 drafts only, not for trainer.family"),
    ("kv_lora_rank", 512, "eagle3 drafts only, not for trainer.family"),
]
BAD_EAGLE3 = [
    ("block_size", 8, "dflash/dspark drafts only, not for trainer.family eagle3"),
    ("dflash_config", {"target_layer_ids": [1]}, "dflash/dspark drafts only, not for trainer.family eagle3"),
    ("num_target_layers", 8, "dflash/dspark drafts only, not for trainer.family eagle3"),
    ("num_hidden_layers", 2, "Input should be 1"),
    ("q_lora_rank", 64, "the MLA draft"),
]


@pytest.mark.parametrize("family", sorted(DRAFTS))
def test_generated_broken_drafts_are_refused_in_one_line_naming_the_field(tmp_path, family):
    """A valid generated draft with one field broken is refused by ``read_recipe`` in one line that names the recipe
    file and ``trainer.draft.<field>``."""
    g = random.Random(f"broken-{family}")
    bad = BAD_ANY + (BAD_EAGLE3 if family == "eagle3" else BAD_BLOCK)
    for i in range(120):
        field, value, says = g.choice(bad)
        draft = gen_draft(g, family)
        draft[field] = value
        path = _recipe_file(tmp_path, family, draft, f"bad{i}.yaml")
        with pytest.raises(KimiInputError) as err:
            read_recipe(path)
        msg = str(err.value)
        named = "trainer.draft." + {"q_lora_rank": "kv_lora_rank"}.get(field, field)  # MLA: the sizes still needed
        assert "\n" not in msg and msg.startswith(f"recipe {path}: {named}"), (field, value, msg)
        assert says in msg, (field, value, msg)


@pytest.mark.parametrize(
    "family,path,value,message",
    [
        (
            "eagle3",
            ("block_size",),
            8,
            "trainer.draft.block_size: dflash/dspark drafts only, not for trainer.family eagle3",
        ),
        ("dflash", ("block_size",), 1, "trainer.draft.block_size: Input should be greater than or equal to 2"),
        ("dflash", ("num_hidden_layers",), 0, "trainer.draft.num_hidden_layers: Input should be greater than 0"),
        (
            "dflash",
            ("draft_vocab_size",),
            256,
            "trainer.draft.draft_vocab_size: eagle3 drafts only, not for trainer.family dflash",
        ),
        ("dflash", ("dflash_config", "markov_rank"), 16, "trainer.draft.dflash_config.markov_rank: dspark drafts only"),
        (
            "dflash",
            ("dflash_config", "target_layer_ids"),
            [],
            "trainer.draft.dflash_config.target_layer_ids: List should",
        ),
        (
            "dspark",
            ("dflash_config", "attention_mode"),
            "GQA",
            "trainer.draft.dflash_config.attention_mode: Input should",
        ),
        (
            "eagle3",
            ("eagle_config", "aux_ids"),
            [1],
            "trainer.draft.eagle_config.aux_ids: Extra inputs are not permitted",
        ),
        ("eagle3", ("num_hidden_layers",), 3, "trainer.draft.num_hidden_layers: Input should be 1"),
    ],
)
def test_specific_bad_fields(tmp_path, family, path, value, message):
    raw = _raw(family)
    node = raw["trainer"]["draft"]
    for key in path[:-1]:
        node = node.setdefault(key, {})
    node[path[-1]] = value
    p = tmp_path / "bad.yaml"
    p.write_text(yaml.safe_dump(raw))
    with pytest.raises(KimiInputError) as err:
        read_recipe(p)
    assert str(err.value).startswith(f"recipe {p}: {message}"), str(err.value)


@pytest.mark.parametrize("name", sorted(p.name for p in RECIPES.glob("*.yaml")))
def test_shipped_recipes_drafts_round_trip(name):
    """Every shipped recipe's draft validates as its family's and its config is the YAML section itself."""
    raw = yaml.safe_load((RECIPES / name).read_text())
    family = raw["trainer"].get("family", "eagle3")
    draft = validate_draft(family, raw["trainer"]["draft"])
    assert json.dumps(draft.config()) == json.dumps(raw["trainer"]["draft"])


def test_model_copy_keeps_the_order_and_adds_new_keys_last():
    raw = _raw("eagle3")["trainer"]["draft"]
    draft = validate_draft("eagle3", raw)
    moved = draft.model_copy(update={"draft_vocab_size": 128, "target_hidden_size": 512})
    assert list(moved.config()) == [*raw, "target_hidden_size"]
    assert moved.config()["draft_vocab_size"] == 128 and moved.draft_vocab_size == 128


@pytest.mark.parametrize("name", sorted(p.name for p in RECIPES.glob("*.yaml")))
def test_a_dumped_recipe_validates_back_to_the_same_draft(name):
    """``Recipe.model_dump()`` then ``model_validate`` (with ``exclude_unset``: what bench/trainer_memory.py's ``row_recipe`` does to vary a recipe) keeps the
    draft as written: no unset field comes back as an explicit ``None`` (SpecForge's HF config refuses one)."""
    recipe = read_recipe(RECIPES / name)
    assert recipe.model_dump()["trainer"]["draft"] == recipe.trainer.draft.config()
    dumped = recipe.model_dump(exclude_unset=True)
    assert dumped["trainer"]["draft"] == recipe.trainer.draft.config()
    again = Recipe.model_validate(dumped)
    assert again.trainer.draft.config() == recipe.trainer.draft.config()
    assert None not in again.trainer.draft.config().values()
