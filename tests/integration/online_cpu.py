"""Builds a recipe's co-located plan for a CPU run: real Mooncake, SpecForge's producer and
torchrun consumer, and the CPU reference capture server in SGLang's place (shared by the
online-loop test and the fault drills)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import yaml
from conftest import TEST_SPEC, prepare_corpus

ROOT = Path(__file__).resolve().parents[2]


def cpu_inputs(root: Path, conversations: int = 40) -> tuple[Path, Path]:
    """The tiny target (``TEST_SPEC``) and ``conversations`` prepared corpus conversations under ``root``."""
    from specforge_kimi.targets.tiny import TinySpec, write_tiny

    target = write_tiny(root / "k25", TinySpec(**TEST_SPEC))
    return target, prepare_corpus(root, conversations, "--standin-tokenizer")


#: a block draft's DFlash ids on ``TEST_SPEC``'s 6 layers: positions [1, 2, 3, 4] (capture after layer id)
BLOCK_IDS = [0, 1, 2, 3]
#: the block draft's block size and anchors on the CPU (small: the objective's logits are anchors x block x vocab)
BLOCK_SIZE, NUM_ANCHORS = 4, 4


def block_draft(raw: dict, family: str) -> None:
    """Rewrites the EAGLE-3 ``raw`` recipe (after :func:`cpu_plan`'s sizes) into a ``family`` block draft on the tiny
    target: DFlash ids :data:`BLOCK_IDS`, a 1-layer Qwen3-style draft at the target's width, sdpa, and the K2.5 mask
    token (inside the tiny target's K2.5 vocabulary)."""
    from specforge_kimi.plan.recipes import K25_MASK_TOKEN_ID

    t, tr = raw["target"], raw["trainer"]
    del t["aux_layer_ids"], tr["ttt_length"]
    raw["data"].pop("vocab_mapping_path")
    raw["bench"] = {"min_acceptance_length": 2.0, "algorithm": "DFLASH", "block_size": BLOCK_SIZE}
    tr["family"] = family
    tr["block"] = {"block_size": BLOCK_SIZE, "num_anchors": NUM_ANCHORS, "mask_token_id": K25_MASK_TOKEN_ID}
    h, heads = t["hidden_size"], 4
    tr["draft"] = {
        "architectures": ["DSparkDraftModel" if family == "dspark" else "DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": h,  # the target's: the draft embeds its noise with the target's embedding
        "intermediate_size": 2 * h,
        "num_attention_heads": heads,
        "num_key_value_heads": heads // 2 if family == "dspark" else heads,  # DSpark's attention is GQA
        "head_dim": h // heads,
        "num_hidden_layers": 1,
        "layer_types": ["full_attention"],
        "hidden_act": "silu",
        "attention_bias": False,
        "rms_norm_eps": 1.0e-06,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "vocab_size": t["vocab_size"],
        "block_size": BLOCK_SIZE,
        "num_target_layers": t["num_layers"],
        "dflash_config": {"target_layer_ids": list(BLOCK_IDS), "mask_token_id": K25_MASK_TOKEN_ID},
        "bos_token_id": 163584,
        "eos_token_id": 163585,
        "pad_token_id": 163839,
        "tie_word_embeddings": False,
    }
    tr["attention_backend"] = "sdpa"  # flex attention has no CPU backward


def cpu_plan(
    root: Path,
    *,
    steps: int,
    save_interval: int,
    conversations: int = 40,
    resilience: dict | None = None,
    dp: int = 1,
    compact_specforge: Path | None = None,
    transport: str = "mooncake",
    inputs: tuple[Path, Path] | None = None,
    family: str = "eagle3",
):
    """``(plan, recipe, rendered, target)`` for a ``dp``-rank (default 1) CPU run under ``root``; ``rendered`` holds
    the compiled ``RunPlan`` as ``run_plan``.

    ``compact_specforge``: a directory holding a SpecForge package patched by ``specforge-kimi
    setup``; the recipe turns ``server.compact_passthrough`` on and the producer and trainer ranks
    import SpecForge from there. ``transport``: the recipe's ``server.transport`` (``cuda_ipc``: the
    reference server writes into a cuda_ipc pool on its shared-memory backend, no Mooncake master).
    ``inputs``: ``(target, data dir)`` of :func:`cpu_inputs` to reuse (default: written under ``root``).
    ``family``: the recipe's ``trainer.family``; a block draft (dflash, dspark) is :func:`block_draft`'s."""
    from specforge_kimi.plan.run_plan import compile_plan
    from specforge_kimi.run.launch import build_colocated_plan
    from specforge_kimi.run.services import free_ports  # at most 55535: SGLang's rule, which recipes enforce

    target, data = inputs or cpu_inputs(root, conversations)

    raw = yaml.safe_load((ROOT / "recipes" / "tiny-k25-tp2-h200x2.yaml").read_text())
    raw["output_dir"] = str(root / "run")
    raw["target"].update(
        path=str(target),
        num_layers=TEST_SPEC["layers"],
        hidden_size=TEST_SPEC["hidden"],
        num_attention_heads=TEST_SPEC["heads"],
        aux_layer_ids=[1, 3, 4],
    )
    raw["gpus"]["per_node"] = dp
    rpc, meta, metrics, keeper, port = free_ports(5)
    raw["mooncake"] = {"rpc_port": rpc, "metadata_port": meta, "metrics_port": metrics, "global_segment_gib": 0.25}
    if resilience:
        raw["resilience"] = {"keeper_port": keeper, **resilience}
    raw["server"]["port"] = port
    raw["trainer"]["draft"].update(
        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=4, draft_vocab_size=256
    )
    raw["trainer"].update(max_steps=steps, save_interval=save_interval, max_length=256)
    raw["server"]["compact_passthrough"] = compact_specforge is not None  # off: SpecForge's JSON lists
    raw["server"]["transport"] = transport
    raw["data"] = {"prompts_path": str(data / "prompts.jsonl"), "vocab_mapping_path": str(data / "vocab_mapping.pt")}
    if family != "eagle3":
        block_draft(raw, family)
    compiled = compile_plan(raw)
    recipe, rendered = compiled.recipe, compiled.write()  # where `launch` renders it
    # CPU trainer: fp32 features and weights, DDP on gloo instead of FSDP (cpu_shims.py says why)
    cfg_path = Path(recipe.output_dir) / "rendered" / "specforge_run.yaml"
    cfg = yaml.safe_load(cfg_path.read_text())
    cfg["model"]["torch_dtype"] = "float32"
    cfg["training"].update(fsdp_sharding="NO_SHARD", log_interval=1)
    cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    rendered["specforge_config"] = cfg
    rendered["run_plan"] = compiled  # what run.launch.export_latest reads

    plan = build_colocated_plan(compiled, python=sys.executable)
    *others, server = plan.services
    old = list(server.command.argv)
    server_ids = old[old.index("--spec-capture-aux-layer-ids") + 1 :][: len(recipe.capture_ids)]
    contract = cfg["model"].get("aux_hidden_state_layer_ids") or recipe.trainer.draft.dflash_config.target_layer_ids
    assert [int(i) for i in server_ids] == contract
    method = old[old.index("--spec-capture-method") + 1]
    assert method == family
    keeper = old[: old.index("--") + 1] if "specforge_kimi.run.keeper" in old else []
    argv = (
        *keeper,
        sys.executable,
        "-m",
        "specforge_kimi.servers.reference_server",
        "--model-path",
        str(target),
        "--spec-capture-aux-layer-ids",
        *server_ids,
        "--host",
        "127.0.0.1",
        "--port",
        str(recipe.server.port),
        "--dtype",
        "float32",
        "--spec-capture-method",
        method,
    )
    env = {**server.command.env, "MOONCAKE_LOCAL_BUFFER_SIZE": str(32 << 20)}
    server = dataclasses.replace(server, command=dataclasses.replace(server.command, argv=argv, env=env))
    commands = plan.commands
    if compact_specforge is not None:
        import os

        path = os.pathsep.join(p for p in (str(compact_specforge), os.environ.get("PYTHONPATH", "")) if p)
        commands = tuple(dataclasses.replace(c, env={**c.env, "PYTHONPATH": path}) for c in commands)
    return dataclasses.replace(plan, services=(*others, server), commands=commands), recipe, rendered, target
