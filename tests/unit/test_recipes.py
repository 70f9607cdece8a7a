"""Every recipe in recipes/ loads, validates, renders a SpecForge-valid config; bad recipes fail clearly."""

import copy
from pathlib import Path

import pytest
import yaml

from specforge_kimi.errors import KimiInputError
from specforge_kimi.plan.recipes import Recipe
from specforge_kimi.plan.run_plan import compile_plan, load_recipe

RECIPES = sorted((Path(__file__).resolve().parents[2] / "recipes").glob("*.yaml"))


def test_recipes_exist():
    names = {p.name for p in RECIPES}
    assert {
        "tiny-k25-tp2-h200x2.yaml",
        "kimi-k25-8xb200-lowered.yaml",
        "kimi-k25-8xb300.yaml",
        "kimi-k25-2x8xb300.yaml",
    } <= names


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_recipe_renders(path, tmp_path):
    text = path.read_text()
    assert text.startswith("# specforge-kimi recipe:") and "# launch:" in text and "memory budget" in text
    plan = compile_plan(path, rendered_dir=tmp_path)  # SpecForge's own Config validates inside
    r = plan.recipe
    assert plan.memory["fits"]
    out = plan.write()
    cfg = out["specforge_config"]
    assert cfg["deployment"]["mode"] == "disaggregated"
    assert cfg["deployment"]["trainer"]["nproc_per_node"] == r.gpus.per_node
    assert cfg["training"]["num_epochs"] == r.trainer.num_epochs
    assert cfg["training"]["attention_backend"] == r.trainer.attention_backend
    if r.target.path.startswith("/models/"):  # a real K2.5: long samples need SpecForge's linear-memory attention
        assert r.trainer.attention_backend == "flex_attention"
    assert cfg["model"]["embedding_key"].startswith("language_model.")
    argv = out["launch"]["capture_server"]
    assert "--enable-spec-capture" in argv and str(r.tp) == argv[argv.index("--tp-size") + 1]
    assert out["launch"]["server_env"]["SPECFORGE_PLUGINS"] == "specforge_kimi"
    assert (tmp_path / "specforge_run.yaml").is_file() and (tmp_path / "draft_config.json").is_file()


def test_num_epochs_reaches_specforge(tmp_path):
    raw = _raw()
    raw["trainer"]["num_epochs"] = 3
    assert (
        compile_plan(Recipe.model_validate(raw), rendered_dir=tmp_path).specforge_config["training"]["num_epochs"] == 3
    )
    raw["trainer"]["num_epochs"] = 0
    with pytest.raises(Exception, match="num_epochs"):
        Recipe.model_validate(raw)


def test_capture_put_clients_reach_the_server_env():
    raw = _raw()
    raw["server"]["transport"] = "mooncake"  # put clients are a Mooncake knob
    assert "SGLANG_SPEC_CAPTURE_PUT_CLIENTS" not in compile_plan(raw).server_env
    raw["server"]["capture_put_clients"] = 4
    assert compile_plan(raw).server_env["SGLANG_SPEC_CAPTURE_PUT_CLIENTS"] == "4"


def test_compact_passthrough_reaches_every_specforge_process(tmp_path):
    """``server.compact_passthrough``: the producer and the trainer ranks of the launch plan get
    ``SPECFORGE_SPEC_CAPTURE_COMPACT=1`` (our SpecForge patch compact-capture-passthrough reads it); off, they do not."""
    import sys

    from specforge_kimi.run.launch import build_colocated_plan

    raw = _raw()
    raw["output_dir"] = str(tmp_path / "run")
    for on in (False, True):
        raw["server"]["compact_passthrough"] = on
        compiled = compile_plan(raw, rendered_dir=tmp_path / f"r{on}")
        rendered = compiled.write()
        plan = build_colocated_plan(compiled, python=sys.executable)
        envs = [c.env for c in plan.commands]
        assert [c.label for c in plan.commands] == ["producer", "consumer"]
        assert all(e.get("SPECFORGE_SPEC_CAPTURE_COMPACT") == ("1" if on else None) for e in envs), envs
        assert all(e["SPECFORGE_PLUGINS"] == "specforge_kimi" for e in envs)
        assert rendered["launch"]["env"].get("SPECFORGE_SPEC_CAPTURE_COMPACT") == ("1" if on else None)


def _raw():
    return yaml.safe_load(
        (Path(__file__).resolve().parents[2] / "recipes" / "kimi-k25-8xb200-lowered.yaml").read_text()
    )


@pytest.mark.parametrize(
    "mutate,msg",
    [
        (lambda r: r.update(surprise=1), "surprise: Extra inputs are not permitted"),
        (lambda r: r["server"].update(mem_fraction_staticc=0.5), "mem_fraction_staticc"),
        (lambda r: r["gpus"].update(per_node=6), "TP=6 does not divide num_attention_heads=64"),
        (lambda r: r["target"].update(aux_layer_ids=[1, 29, 60]), "residual positions 1..60"),
        (lambda r: r["server"].update(mem_fraction_static=0.3), "server needs 69.2 GiB weights"),
        (lambda r: r["server"].update(mem_fraction_static=0.9), "trainer peak"),
        (lambda r: r["trainer"]["draft"].update(hidden_size=4096), "draft hidden_size 4096 != target"),
        (lambda r: r["gpus"].update(nnodes=2), "multi-node recipe needs server.host"),
        (
            lambda r: (r["gpus"].update(nnodes=2), r["server"].update(host="10.0.0.1")),
            "multi-node recipe needs trainer.consumer_state_dir",
        ),
        (
            lambda r: (
                r["gpus"].update(nnodes=2),
                r["server"].update(host="10.0.0.1"),
                r["trainer"].update(consumer_state_dir="/local/cs"),
                r.update(resilience={"consumer_restarts": 1}),
            ),
            "consumer_restarts is single-node only",
        ),
        (
            lambda r: r["trainer"]["draft"].update(eagle_config={"eagle_aux_hidden_state_layer_ids": [2, 30, 58]}),
            r"eagle_aux_hidden_state_layer_ids \[2, 30, 58\] != target.aux_layer_ids \[1, 29, 57\]",
        ),
        (
            lambda r: (r["server"].update(capture_put_clients=2), r.update(resilience={"segment_owner": "keeper"})),
            "capture_put_clients > 1 splits the server's own segment",
        ),
        (lambda r: r["server"].update(capture_put_clients=0), "capture_put_clients"),
        # SpecForge's Mooncake config refuses these with a pydantic error of its own: the recipe says so first
        (lambda r: r.update(mooncake={"host": ""}), "mooncake.host: String should match pattern"),
        (lambda r: r.update(mooncake={"host": " 10.0.0.1"}), "mooncake.host: String should match pattern"),
        (lambda r: r.update(mooncake={"rpc_port": 70000}), "mooncake.rpc_port: Input should be less than 65536"),
        (lambda r: r.update(mooncake={"metrics_port": 35880}), "rpc_port, metadata_port and metrics_port must differ"),
        (lambda r: r["server"].update(host=""), "server.host: String should match pattern"),
        # SpecForge's eager (sdpa) TTT attention at 4k tokens: 6 B x 56 heads x 7 steps x 4096^2 = 36.8 GiB more
        (lambda r: r["trainer"].update(attention_backend="sdpa"), "trainer peak ~91.1 GiB"),
        (lambda r: r["trainer"].update(attention_backend="usp"), "attention_backend"),
        (
            lambda r: r["trainer"]["draft"].update(
                kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128
            ),
            "MLA draft .* sdpa only",
        ),
    ],
)
def test_bad_recipes(tmp_path, mutate, msg):
    raw = copy.deepcopy(_raw())
    mutate(raw)
    p = tmp_path / "bad.yaml"
    p.write_text(yaml.safe_dump(raw))
    with pytest.raises(KimiInputError, match=msg):
        load_recipe(p)


def test_schema_forbids_extra_everywhere():
    for model in Recipe.model_fields.values():
        ann = model.annotation
        if hasattr(ann, "model_config"):
            assert ann.model_config.get("extra") == "forbid"


# ---- block drafts (trainer.family dflash / dspark) ---------------------------------------------------------------
BLOCK_RECIPES = (
    "tiny-k25-tp1-h200-dflash.yaml",
    "kimi-k25-slice-h200-dflash.yaml",
    "kimi-k25-8xb200-lowered-dflash.yaml",
)


def _raw_block(name: str = "tiny-k25-tp1-h200-dflash.yaml") -> dict:
    return yaml.safe_load((Path(__file__).resolve().parents[2] / "recipes" / name).read_text())


def test_block_recipes_exist_and_name_their_ids_as_positions():
    names = {p.name for p in RECIPES}
    assert set(BLOCK_RECIPES) <= names
    for name in BLOCK_RECIPES:
        r = load_recipe(Path(__file__).resolve().parents[2] / "recipes" / name)
        assert r.trainer.family == "dflash" and r.bench.algorithm == "DFLASH" and r.bench_block_size == 8
        ids = r.trainer.draft.dflash_config.target_layer_ids
        assert list(r.capture_layers.positions) == [i + 1 for i in ids]
        assert (
            f"positions {[i + 1 for i in ids]}" in (Path(__file__).resolve().parents[2] / "recipes" / name).read_text()
        )


def _dc(r):
    return r["trainer"]["draft"]["dflash_config"]


def _dspark(r, kv=4, **dc):
    r["trainer"].update(family="dspark", dspark={"ce": 0.1, "l1": 0.9, "confidence": 1.0})
    r["trainer"]["draft"].update(architectures=["DSparkDraftModel"], num_key_value_heads=kv)
    _dc(r).update(dc)


@pytest.mark.parametrize(
    "mutate,msg",
    [
        (
            lambda r: _dspark(r, kv=8),
            "trainer.draft.num_key_value_heads: 8 must be < num_attention_heads 8: DSpark is GQA",
        ),
        (lambda r: _dspark(r, kv=3), "trainer.draft.num_key_value_heads: 3 must divide num_attention_heads 8"),
        (
            lambda r: _dspark(r, kv=4, attention_mode="mha"),
            "num_key_value_heads: 4 must equal num_attention_heads 8 under",
        ),
        (
            lambda r: _dspark(r, kv=4, attention_mode="sliding"),
            "trainer.draft.dflash_config.attention_mode: Input should be 'gqa' or 'mha'",
        ),
    ],
)
def test_bad_dspark_heads_are_refused_in_one_line(tmp_path, mutate, msg):
    """SpecForge's DSparkDraftModel refuses these in the trainer, minutes into a run; the recipe refuses them first."""
    raw = _raw_block()
    mutate(raw)
    p = tmp_path / "bad.yaml"
    p.write_text(yaml.safe_dump(raw))
    with pytest.raises(KimiInputError, match=msg) as err:
        load_recipe(p)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("kv,mode", [(4, None), (8, "mha")])
def test_dspark_heads_specforge_accepts_pass(tmp_path, kv, mode):
    raw = _raw_block()
    _dspark(raw, kv=kv, **({"attention_mode": mode} if mode else {}))
    p = tmp_path / "ok.yaml"
    p.write_text(yaml.safe_dump(raw))
    assert load_recipe(p).trainer.family == "dspark"


@pytest.mark.parametrize(
    "mutate,msg",
    [
        (lambda r: r["trainer"]["draft"].update(num_target_layers=61), "num_target_layers 61 != target.num_layers 8"),
        (lambda r: _dc(r).update(target_layer_ids=[1, 2, 3, 4, 7]), r"takes 0\.\.6"),
        (lambda r: _dc(r).update(target_layer_ids=[1, 2, 2, 4]), "duplicated"),
        (lambda r: _dc(r).pop("target_layer_ids"), "trainer.draft.dflash_config.target_layer_ids: Field required"),
        (lambda r: _dc(r).update(mask_token_id=163839), r"mask_token_id 163839 != trainer.block.mask_token_id 163824"),
        (lambda r: _dc(r).pop("mask_token_id"), r"trainer.draft.dflash_config.mask_token_id: Field required"),
        (
            lambda r: (_dc(r).update(mask_token_id=163839), r["trainer"]["block"].update(mask_token_id=163839)),
            r"K2.5's \[PAD\], a token in use",
        ),
        (
            lambda r: (_dc(r).update(mask_token_id=200000), r["trainer"]["block"].update(mask_token_id=200000)),
            "outside the vocabulary",
        ),
        (lambda r: r["trainer"]["draft"].update(block_size=16), "draft block_size 16 != trainer.block.block_size 8"),
        (lambda r: r["trainer"]["draft"].update(layer_types=[]), "trainer.draft.layer_types: 0 entries for 1 layers"),
        (
            lambda r: r["trainer"]["draft"].update(layer_types=10**30),
            "trainer.draft.layer_types: Input should be a valid list",
        ),
        (
            lambda r: r["trainer"]["draft"].update(layer_types=[1]),
            "trainer.draft.layer_types.0: Input should be 'full_",
        ),
        (lambda r: r["trainer"]["draft"].pop("head_dim"), "trainer.draft.head_dim: Field required"),
        (lambda r: r["trainer"]["draft"].update(hidden_size=256), "draft hidden_size 256 != target"),
        (lambda r: r["trainer"].update(step_empty_cache=True), "trainer.step_empty_cache: EAGLE-3 only"),
        (lambda r: r["trainer"].update(step_fewer_host_syncs=False), "trainer.step_fewer_host_syncs: EAGLE-3 only"),
        (lambda r: r["trainer"].update(step_chunked_head_loss=1024), "trainer.step_chunked_head_loss: EAGLE-3 only"),
        (lambda r: r["trainer"].update(ttt_length=7), "trainer.ttt_length: EAGLE-3 only"),
        (
            lambda r: r["trainer"]["draft"].update(draft_vocab_size=256),
            "trainer.draft.draft_vocab_size: eagle3 drafts only, not for trainer.family dflash",
        ),
        (lambda r: r["bench"].update(steps=3), "bench.steps: EAGLE-3 only"),
        (lambda r: r["bench"].update(algorithm="EAGLE3"), "bench.algorithm must be DFLASH"),
        (lambda r: r["bench"].update(block_size=1), "block_size"),
        (lambda r: r["target"].update(aux_layer_ids=[1, 3, 6]), "target.aux_layer_ids is EAGLE-3's"),
        (lambda r: r["data"].update(vocab_mapping_path="v.pt"), "data.vocab_mapping_path is EAGLE-3's"),
        (lambda r: r["trainer"].pop("block"), "trainer.family dflash needs trainer.block"),
        (lambda r: r["trainer"].update(dspark={"ce": 0.5}), "trainer.dspark is for trainer.family dspark"),
        (lambda r: r["trainer"]["block"].update(gamma=4), "block.gamma: Extra inputs are not permitted"),
        (lambda r: r["trainer"]["block"].update(block_size=1), "block_size"),
        (lambda r: r["trainer"].update(family="medusa"), "family"),
        (lambda r: r["trainer"].update(family="eagle3"), "trainer.draft.block_size: dflash/dspark drafts only"),
    ],
)
def test_bad_block_recipes(tmp_path, mutate, msg):
    raw = _raw_block()
    mutate(raw)
    p = tmp_path / "bad.yaml"
    p.write_text(yaml.safe_dump(raw))
    with pytest.raises(KimiInputError, match=msg) as err:
        load_recipe(p)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "mutate,msg",
    [
        (lambda r: r["bench"].update(algorithm="DFLASH"), "bench.algorithm DFLASH and bench.block_size are for block"),
        (lambda r: r["bench"].update(block_size=8), "bench.algorithm DFLASH and bench.block_size are for block"),
        (lambda r: r["trainer"].update(block={"block_size": 8}), "trainer.block is for block drafts"),
        (lambda r: r["target"].pop("aux_layer_ids"), "target.aux_layer_ids is required for trainer.family eagle3"),
        (lambda r: r["data"].pop("vocab_mapping_path"), "data.vocab_mapping_path is required"),
    ],
)
def test_eagle3_recipes_refuse_block_fields(tmp_path, mutate, msg):
    raw = copy.deepcopy(_raw())
    mutate(raw)
    p = tmp_path / "bad.yaml"
    p.write_text(yaml.safe_dump(raw))
    with pytest.raises(KimiInputError, match=msg):
        load_recipe(p)


def test_block_draft_params_equal_specforges_model():
    """The memory plan's parameter count of a block draft is SpecForge's DFlashDraftModel's (tiny recipe's shape)."""
    import torch
    from specforge.modeling.draft.dflash import DFlashDraftModel
    from transformers import Qwen3Config

    from specforge_kimi.plan.draft_config import validate_draft
    from specforge_kimi.plan.trainer_terms import block_draft_params

    d = _raw_block()["trainer"]["draft"]
    with torch.device("meta"):
        model = DFlashDraftModel(Qwen3Config(**d))
    assert block_draft_params(validate_draft("dflash", d)) == sum(p.numel() for p in model.parameters())


def test_a_mooncake_config_specforge_refuses_is_one_line(tmp_path, monkeypatch):
    """Whatever SpecForge's own Mooncake config refuses that the schema let through is the recipe's one line, not a
    pydantic traceback (the schema refuses the cases known today: an empty or spaced host, ports)."""
    from specforge_kimi.plan import roles

    real = roles.mooncake_config
    monkeypatch.setattr(roles, "mooncake_config", lambda **kw: real(**{**kw, "local_hostname": " h"}))
    p = tmp_path / "r.yaml"
    p.write_text(yaml.safe_dump(_raw()))
    with pytest.raises(KimiInputError, match=r"^recipe .*r\.yaml: SpecForge's Mooncake config: .*local_hostname"):
        load_recipe(p)
