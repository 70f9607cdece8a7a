"""The embedded demo end to end at reduced size: loss falls, simulated acceptance rises, export sound."""

import json
import re

import pytest

from specforge_kimi.demo.pipeline import DemoSettings, run_demo
from specforge_kimi.drafts.export import check_sglang_export
from specforge_kimi.errors import KimiInputError


@pytest.mark.slow
def test_demo_small(tmp_path, capfd):
    out = tmp_path / "demo"
    # a step-bounded target: a 25 s budget gave 38 or 39 steps by machine load, and the draft's gain was
    # +0.09 on one such target, +0.68 on another (60 steps: +0.24); 100 steps gave +0.47 and +0.52
    s = DemoSettings(
        out_dir=str(out),
        steps=120,
        pretrain_seconds=600,
        pretrain_steps=100,
        train_conversations=240,
        heldout_conversations=24,
    )
    result = run_demo(s)
    console = capfd.readouterr()
    on_disk = json.loads((out / "demo_result.json").read_text())
    assert on_disk["train"]["steps"] == 120 == len(on_disk["train"]["losses"])
    assert on_disk["target"]["pretrain_steps"] == 100
    held = result["heldout_loss"]
    assert held["after"] < held["before"] - 0.1, held
    sim = result["simulated_acceptance"]
    assert sim["after"] - sim["before"] >= 0.3, sim
    assert (out / "loss_curve.png").stat().st_size > 10_000
    summary = check_sglang_export(out / "export-sglang", target_dir=out / "target")
    assert summary["captured_positions"] == [2, 3, 4]
    assert (out / "export-sglang" / "provenance.json").is_file()
    # the console (not a terminal here): a line per stage and a few plain progress lines, no carriage
    # return, no SpecForge metric dict, no import-time notice; SpecForge's per-step lines are in its log
    text = console.out + console.err
    assert "\r" not in text and "{'" not in text and "flash_attn" not in text, text[-3000:]
    lines = text.splitlines()
    assert len(lines) < 40, lines
    assert any(line.startswith("[5/6] train: done, 120/120 step (100%), loss ") for line in lines), lines
    assert any(line.startswith("[2/6] pretrain: done, 100/100 step (100%)") for line in lines), lines
    log = (out / "specforge.log").read_text()
    assert len(re.findall(r"^step \d+: \{", log, re.M)) == 120


def test_demo_refuses_foreign_directory(tmp_path):
    (tmp_path / "precious.txt").write_text("keep me")
    with pytest.raises(KimiInputError, match="not a demo directory"):
        run_demo(DemoSettings(out_dir=str(tmp_path), progress=False))
    assert (tmp_path / "precious.txt").read_text() == "keep me"
