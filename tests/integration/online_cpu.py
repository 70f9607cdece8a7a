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
):
    """``(plan, recipe, rendered, target)`` for a ``dp``-rank (default 1) CPU run under ``root``.

    ``compact_specforge``: a directory holding a SpecForge package patched by ``specforge-kimi
    setup``; the recipe turns ``server.compact_passthrough`` on and the producer and trainer ranks
    import SpecForge from there. ``transport``: the recipe's ``server.transport`` (``cuda_ipc``: the
    reference server writes into a cuda_ipc pool on its shared-memory backend, no Mooncake master).
    ``inputs``: ``(target, data dir)`` of :func:`cpu_inputs` to reuse (default: written under ``root``)."""
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
    compiled = compile_plan(raw)
    recipe, rendered = compiled.recipe, compiled.write()  # where `launch` renders it
    # CPU trainer: fp32 features and weights, DDP on gloo instead of FSDP (cpu_shims.py says why)
    cfg_path = Path(recipe.output_dir) / "rendered" / "specforge_run.yaml"
    cfg = yaml.safe_load(cfg_path.read_text())
    cfg["model"]["torch_dtype"] = "float32"
    cfg["training"].update(fsdp_sharding="NO_SHARD", log_interval=1)
    cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    rendered["specforge_config"] = cfg

    plan = build_colocated_plan(compiled, python=sys.executable)
    *others, server = plan.services
    old = list(server.command.argv)
    server_ids = old[old.index("--spec-capture-aux-layer-ids") + 1 :][:3]
    assert [int(i) for i in server_ids] == cfg["model"]["aux_hidden_state_layer_ids"]
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
    )
    env = {**server.command.env, "MOONCAKE_LOCAL_BUFFER_SIZE": str(32 << 20)}
    server = dataclasses.replace(server, command=dataclasses.replace(server.command, argv=argv, env=env))
    commands = plan.commands
    if compact_specforge is not None:
        import os

        path = os.pathsep.join(p for p in (str(compact_specforge), os.environ.get("PYTHONPATH", "")) if p)
        commands = tuple(dataclasses.replace(c, env={**c.env, "PYTHONPATH": path}) for c in commands)
    return dataclasses.replace(plan, services=(*others, server), commands=commands), recipe, rendered, target
