"""`capture-features` writes SpecForge offline feature files through the recipe's capture path
(CPU reference capture server in SGLang's place, real Mooncake, SpecForge's producer transport and
feature store), equal to the reference capture, and SpecForge's offline trainer reads them."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from online_cpu import cpu_plan

pytestmark = pytest.mark.slow


def test_capture_features_round_trip(tmp_path, capsys):
    from specforge_kimi.run.offline_twin import run_recipe
    from specforge_kimi.targets.capture import capture
    from specforge_kimi.targets.checkpoint import load_text_model
    from specforge_kimi.targets.layer_ids import AuxLayers

    _plan, recipe, rendered, target = cpu_plan(tmp_path, steps=4, save_interval=0)
    argv = [
        sys.executable,
        "-m",
        "specforge_kimi.servers.reference_server",
        "--model-path",
        str(target),
        "--spec-capture-aux-layer-ids",
        "1",
        "3",
        "4",
        "--port",
        "0",
        "--dtype",
        "float32",
    ]
    from specforge_kimi.plan.run_plan import compile_plan

    summary = run_recipe(compile_plan(recipe), tmp_path / "features", limit=5, server_argv=argv, start_timeout_s=120)
    assert summary["written"] == 5
    files = sorted((tmp_path / "features").glob("sample-*.ckpt"))
    assert len(files) == 5 and not list(tmp_path.glob(".features.partial-*"))

    rows = [json.loads(line) for line in open(recipe.data.prompts_path)][:5]
    model = load_text_model(target)
    aux = AuxLayers.from_specforge([1, 3, 4], recipe.target.num_layers)
    for row, f in zip(rows, files, strict=False):
        sample = torch.load(f)
        assert sample["input_ids"].tolist() == row["input_ids"] and sample["loss_mask"].tolist() == row["loss_mask"]
        ref = capture(model, torch.tensor([row["input_ids"]]), aux)
        torch.testing.assert_close(sample["aux_hidden_state"], ref.aux)
        torch.testing.assert_close(sample["hidden_state"], ref.last)

    # the recipe's offline twin: same draft, vocab mapping, lr, TTT, seed; then the SGLang export
    from specforge_kimi.cli import main
    from specforge_kimi.drafts.export import check_sglang_export

    raw = recipe.model_dump()
    raw["trainer"]["draft"] = json.loads(open(rendered["specforge_config"]["model"]["draft_model_config"]).read())
    recipe_path = tmp_path / "recipe.yaml"
    recipe_path.write_text(__import__("yaml").safe_dump(raw))
    assert (
        main(
            [
                "train-offline",
                str(recipe_path),
                "--features",
                str(tmp_path / "features"),
                "--out",
                str(tmp_path / "offline"),
                "--steps",
                "3",
            ]
        )
        == 0
    )
    cap = capsys.readouterr()
    out = cap.out
    assert json.loads(out[out.rindex("\n{\n") + 1 :])["steps"] == 3
    # SpecForge's per-step dicts go to its log; the console has a progress line per quarter and the summary
    log = (tmp_path / "offline" / "specforge.log").read_text()
    assert [line.split(":")[0] for line in log.splitlines() if line.startswith("step ")] == [
        "step 1",
        "step 2",
        "step 3",
    ]
    assert "{'" not in out + cap.err and "train-offline: done, 3/3 step (100%)" in cap.err
    assert check_sglang_export(tmp_path / "offline" / "export-sglang", target_dir=target)["captured_positions"] == [
        2,
        4,
        5,
    ]
