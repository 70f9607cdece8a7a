"""A DFlash block draft trained online on CPU, on both transports: the recipe's co-located plan (``trainer.family:
dflash``), SpecForge's real ``dflash`` producer and torchrun consumer through ``register()``'s seams, and the CPU
reference capture server (``--spec-capture-method dflash``) capturing the N target layers the draft names.

What this proves without a GPU: the plan compiles a block draft into the server's capture method and DFlash ids,
SpecForge's config (strategy, mask token, block knobs) and the processes' environment (no eagle3 step switch);
SpecForge's DFlash model loads the K2.5 target's embedding and head through the weight-keys seam (``language_model.``
keys) and trains on features N x hidden wide, each sample acknowledged once in SpecForge's ledger, on Mooncake and on
the cuda_ipc pool; its checkpoint exports for SGLang's DFLASH with ``specforge-kimi export``; nothing is left
behind. SGLang's own N-layer capture is the GPU parity test's (``tests/gpu``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import TEST_SPEC
from online_cpu import BLOCK_IDS, BLOCK_SIZE, cpu_plan

from specforge_kimi.run.progress import consumer_steps

pytestmark = pytest.mark.slow

STEPS = 4
WIDTH = len(BLOCK_IDS) * TEST_SPEC["hidden"]  # the N captured layers side by side


@pytest.fixture(scope="module", params=["mooncake", "cuda_ipc"])
def block_run(request, tmp_path_factory):
    from specforge_kimi.run.launch import run_plan

    root = tmp_path_factory.mktemp(f"dflash-{request.param}")
    plan, recipe, rendered, target = cpu_plan(
        root, steps=STEPS, save_interval=STEPS // 2, conversations=12, transport=request.param, family="dflash"
    )
    spawned = []

    def popen(*a, **k):
        p = subprocess.Popen(*a, **k)
        spawned.append(p)
        return p

    rc = run_plan(plan, managed_preflight=lambda _p: None, popen=popen)
    time.sleep(0.5)
    out = Path(recipe.output_dir)
    export = None
    if rc == 0:  # the command a user runs on a finished run's checkpoint
        export = subprocess.run(
            [sys.executable, "-m", "specforge_kimi", "export", "--checkpoint", str(out / f"{recipe.name}-step{STEPS}")]
            + ["--draft-config", rendered["specforge_config"]["model"]["draft_model_config"], "--target", str(target)]
            + ["--out", str(out / "export-sglang"), "--mask-token-id", str(recipe.trainer.block.mask_token_id)],
            capture_output=True,
            text=True,
            timeout=300,
        )
    return {
        "transport": request.param,
        "rc": rc,
        "plan": plan,
        "recipe": recipe,
        "rendered": rendered,
        "target": target,
        "out": out,
        "spawned": spawned,
        "export": export,
    }


def _log(run, name: str) -> str:
    return (run["out"] / "logs" / name).read_text(errors="replace")


def test_plan_renders_a_dflash_run(block_run):
    recipe, cfg = block_run["recipe"], block_run["rendered"]["specforge_config"]
    assert recipe.trainer.family == "dflash" and recipe.capture_ids == BLOCK_IDS
    assert cfg["training"]["strategy"] == "dflash" and cfg["training"]["num_anchors"] == 4
    assert cfg["model"]["mask_token_id"] == recipe.trainer.block.mask_token_id
    assert "aux_hidden_state_layer_ids" not in cfg["model"] and "vocab_mapping_path" not in cfg["model"]
    for command in block_run["plan"].commands:  # the block step reads no eagle3 switch: none set, no patch needed
        assert not any(k.startswith("SPECFORGE_EAGLE3_") for k in command.env), command.label
    server = _log(block_run, "capture-server-node0.log")
    assert "(dflash ids [0, 1, 2, 3] -> positions [1, 2, 3, 4], float32)" in server, server[:2000]


def test_trains_every_step_once(block_run):
    from specforge_kimi.evaluate.run_report import report

    assert block_run["rc"] == 0, _log(block_run, "consumer-node0.log")[-3000:]
    producer = _log(block_run, "producer.log")
    assert re.search(r"drive_producer returning produced=\d+ prompts_failed=0", producer), producer[-2000:]
    losses = [row["loss"] for row in consumer_steps(_log(block_run, "consumer-node0.log"))]
    assert len(losses) == STEPS and all(x == x and x > 0 for x in losses), losses
    rep = report(block_run["out"])
    led = rep["ledger"]
    assert rep["transport"] == block_run["transport"]
    assert rep["draft"]["strategy"] == "dflash" and rep["draft"]["architecture"] == "DFlashDraftModel"
    assert rep["draft"]["draft_block_size"] == BLOCK_SIZE and rep["draft"]["target_layer_ids"] == BLOCK_IDS
    assert rep["draft"]["target_hidden_size"] == TEST_SPEC["hidden"]
    assert set(rep["acc_last_mean"]) == {"acc"}  # the block strategy logs one accuracy over the block
    assert led["global_step"] == STEPS and led["acked"] == led["acked_unique"] == STEPS
    assert led["duplicates"] == 0 and led["acked_not_committed"] == 0 and led["trained_tokens"] > 0


def test_features_are_n_layers_wide(block_run):
    """What the trainer got: each ref's ``hidden_states`` is the N layers side by side with DFlash's two
    passthroughs (no last hidden state, no EAGLE-3 target), and the trained model's ``fc`` reads N x hidden."""
    import torch

    refs = [json.loads(line) for line in (block_run["out"] / "control" / "refs.jsonl").read_text().splitlines()]
    assert refs and all(r["strategy"] == "dflash" for r in refs)
    for r in refs:
        specs = r["feature_specs"]
        assert sorted(specs) == ["hidden_states", "input_ids", "loss_mask"], sorted(specs)
        assert specs["hidden_states"]["shape"] == [1, r["num_tokens"], WIDTH]
    name = block_run["recipe"].name
    state = torch.load(block_run["out"] / f"{name}-step{STEPS}" / "training_state.pt", weights_only=False)
    assert state["strategy"] == "dflash" and state["global_step"] == STEPS
    assert list(state["dflash_target_layer_ids"]) == BLOCK_IDS and state["dflash_block_size"] == BLOCK_SIZE
    assert state["dflash_mask_token_id"] == block_run["recipe"].trainer.block.mask_token_id
    assert tuple(state["draft_state_dict"]["fc.weight"].shape) == (TEST_SPEC["hidden"], WIDTH)
    assert (block_run["out"] / f"{name}-step{STEPS // 2}" / "training_state.pt").is_file()


def test_export_for_sglang_dflash(block_run):
    from specforge_kimi.drafts.export import check_any_export

    res = block_run["export"]
    assert res is not None and res.returncode == 0, (res.stdout + res.stderr)[-3000:] if res else "no run"
    export = block_run["out"] / "export-sglang"
    summary = check_any_export(export, block_run["target"])
    assert summary["architecture"] == "DFlashDraftModel" and summary["captured_positions"] == [1, 2, 3, 4]
    assert summary["target_layer_ids"] == BLOCK_IDS and summary["block_size"] == BLOCK_SIZE
    config = json.loads((export / "config.json").read_text())
    assert config["dflash_config"]["mask_token_id"] == block_run["recipe"].trainer.block.mask_token_id


def test_nothing_left_behind(block_run):
    from specforge_kimi.evaluate.run_report import disk_bytes
    from specforge_kimi.transport.slots import shm_dir

    out = block_run["out"]
    assert block_run["spawned"] and not any(p.poll() is None for p in block_run["spawned"])
    for p in block_run["spawned"]:
        with pytest.raises(ProcessLookupError):
            os.kill(p.pid, 0)
    assert not list(out.rglob("*.ckpt"))  # no offline feature files
    refs = [json.loads(line) for line in (out / "control" / "refs.jsonl").read_text().splitlines()]
    assert disk_bytes(out, block_run["recipe"].name)["metadata"] < sum(r["estimated_bytes"] for r in refs) / 2
    if block_run["transport"] == "cuda_ipc":
        assert not any("mooncake" in " ".join(map(str, p.args)) for p in block_run["spawned"])
        pool = refs[0]["metadata"]["cuda_ipc"]["pool"]
        assert not list((out / "ipc").glob("*.json")) and not list(shm_dir().glob(f"sfk-ipc-{pool}.*"))
        closed = re.findall(r"cuda_ipc pool \w+ closed: (\{.*\})$", _log(block_run, "capture-server-node0.log"), re.M)
        assert len(closed) == 1 and json.loads(closed[0])["expired"] == 0
