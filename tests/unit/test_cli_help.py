"""The CLI as a new user meets it: --version, commands grouped by stage, help on every argument with
its default, `layer-ids` as a short table, `launch --plan` writing nothing, `eval-draft`'s scope."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from specforge_kimi import cli
from specforge_kimi.provenance import VERSION

ROOT = Path(__file__).resolve().parents[2]


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_version():
    res = subprocess.run([sys.executable, "-m", "specforge_kimi", "--version"], capture_output=True, text=True)
    assert res.returncode == 0 and res.stdout.strip() == f"specforge-kimi {VERSION}"


def test_commands_grouped_by_stage():
    parser = cli.build_parser()
    text = parser.format_help()
    commands = _subparsers(parser)
    groups = [g for g in cli.COMMAND_GROUPS]
    positions = [text.index(f"  {g}:\n") for g in groups]
    assert positions == sorted(positions), "groups in stage order"
    listed = re.findall(r"^    (\S+)  ", text, re.M)
    assert sorted(listed) == sorted(commands), "every command listed exactly once"
    assert "{" not in text.split("commands, by stage")[0], "no flat {a,b,c,...} list"
    tiny = text[text.index("  tiny / dev") :]
    assert all(name in tiny for name in ("demo", "tiny", "eval-draft", "target-text"))


def test_a_command_missing_from_the_groups_is_still_listed(monkeypatch):
    groups = {k: tuple(n for n in v if n != "watch") for k, v in cli.COMMAND_GROUPS.items()}
    monkeypatch.setattr(cli, "COMMAND_GROUPS", groups)
    text = cli.build_parser().format_help()
    assert re.search(r"^  other:\n    watch ", text, re.M)


def _actions():
    for name, sub in _subparsers(cli.build_parser()).items():
        for action in sub._actions:
            if not isinstance(action, argparse._HelpAction):
                yield name, sub, action


def test_every_argument_has_help_and_shows_its_default():
    missing = [(n, a.option_strings or a.dest) for n, _, a in _actions() if not a.help]
    assert not missing, missing
    for sub in _subparsers(cli.build_parser()).values():
        sub.format_help()  # every help string formats (a stray % would raise here)
    undefaulted = []
    for name, sub, a in _actions():
        if a.option_strings and a.default not in (None, False, [], argparse.SUPPRESS) and a.default is not True:
            if "default" not in sub._get_formatter()._get_help_string(a).lower():
                undefaulted.append((name, a.option_strings))
    assert not undefaulted, undefaulted


def test_layer_ids_is_a_short_table_naming_the_recipe_ids(capsys):
    assert cli.main(["layer-ids", "1,29,57"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) <= 8, lines
    assert lines[-1].startswith("put [1, 29, 57] into the recipe's target.aux_layer_ids")
    assert any(line.split()[-1] == "2,30,58" and "captured positions" in line for line in lines)
    assert cli.main(["layer-ids", "2,30,58", "--engine", "vllm"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "put [2, 30, 58] into the recipe's target.aux_layer_ids"
    assert cli.main(["layer-ids", "1,29,57", "--json"]) == 0
    table = json.loads(capsys.readouterr().out)
    assert table["recipe_aux_layer_ids"] == [1, 29, 57] and table["captured_positions"] == [2, 30, 58]


def test_layer_ids_shows_dflash_ids(capsys):
    """A block draft's DFlash ids (position = id + 1) are an engine of ``layer-ids``: id 0 (position 1, which no
    EAGLE-3 list reaches first in SGLang) is shown, not refused, and the line names the draft config's field."""
    assert cli.main(["layer-ids", "0,1,2,3", "--engine", "dflash", "--num-layers", "6"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) <= 8, lines
    assert any(line.split()[-1] == "1,2,3,4" and "captured positions" in line for line in lines)
    assert lines[-1].startswith("put [0, 1, 2, 3] into a block draft's trainer.draft.dflash_config.target_layer_ids")
    assert "EAGLE-3 cannot capture" in lines[-1]
    assert cli.main(["layer-ids", "1,29,57", "--engine", "dflash", "--json"]) == 0
    table = json.loads(capsys.readouterr().out)
    assert table["dflash"] == [1, 29, 57] and table["captured_positions"] == [2, 30, 58]
    assert table["recipe_aux_layer_ids"] == [2, 30, 58]  # EAGLE-3's ids for the same positions
    assert cli.main(["layer-ids", "1,29,57"]) == 0  # EAGLE-3's ids: the DFlash view beside them
    assert any(
        line.split()[-1] == "1,29,57" and "dflash_config" in line for line in capsys.readouterr().out.splitlines()
    )


def test_launch_plan_writes_nothing_and_prints_one_json_document(tmp_path, capsys, monkeypatch):
    raw = yaml.safe_load((ROOT / "recipes" / "tiny-k25-tp1-h200.yaml").read_text())
    out = tmp_path / "run"
    raw["output_dir"] = str(out)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(raw))
    monkeypatch.chdir(tmp_path)
    assert cli.main(["launch", str(recipe), "--plan"]) == 0
    doc = json.loads(capsys.readouterr().out)  # one document: json.loads refuses two
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["recipe.yaml"]
    assert doc["written"] is False and doc["rendered_dir"] == str(out / "rendered")
    labels = [c["label"] for c in doc["plan"]["commands"]] + [s["command"]["label"] for s in doc["plan"]["services"]]
    assert {"producer", "consumer", "capture-server"} <= set(labels)  # cuda_ipc, the recipe's transport: no master
    assert "mooncake" not in labels and doc["transport"]["transport"] == "cuda_ipc"
    producer = next(c for c in doc["plan"]["commands"] if c["label"] == "producer")
    assert str(out / "rendered" / "specforge_run.yaml") in " ".join(producer["argv"])
    assert doc["specforge_config"]["tracking"]["report_to"] == "tensorboard" and doc["memory_plan"]["fits"]
    disk = doc["disk"]  # max_steps 3000, save_interval 1000: three saves, all kept
    assert disk["checkpoints_kept"] == 3 and disk["estimate"].startswith("3 checkpoint(s) x ")
    assert disk["total_bytes"] == 3 * disk["checkpoint_bytes"] + disk["export_bytes"] > 0


def test_eval_draft_states_its_scope():
    sub = _subparsers(cli.build_parser())["eval-draft"]
    assert "tiny" in sub.description.lower() and "bench" in sub.description
    assert "tiny targets only" in cli.build_parser().format_help()


@pytest.mark.parametrize("command", ["watch", "run-report", "launch", "doctor"])
def test_help_of_the_online_commands(command, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main([command, "--help"])
    assert exc.value.code == 0
    assert "usage: specforge-kimi " + command in capsys.readouterr().out
