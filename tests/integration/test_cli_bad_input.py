"""Bad input through the CLI: one `error:` line naming the cause, exit code 2, nothing half-written."""

import json
import subprocess
import sys

import pytest


def _cli(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "specforge_kimi", *args], capture_output=True, text=True, timeout=300, cwd=cwd
    )


def _one_error_line(res, needle):
    assert res.returncode == 2, (res.returncode, res.stderr[-1500:])
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("error: ") and needle in lines[-1], lines[-3:]
    assert "Traceback" not in res.stderr


def test_tiny_bad_vocab_leaves_nothing(tmp_path):
    out = tmp_path / "t"
    _one_error_line(_cli("tiny", str(out), "--vocab", "1000"), "cannot hold K2.5's special ids")
    assert not out.exists() and not (tmp_path / "t.partial").exists()


def test_tiny_refuses_non_empty_dir(tmp_path):
    (tmp_path / "keep.txt").write_text("x")
    _one_error_line(_cli("tiny", str(tmp_path)), "exists and is not empty")
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]


def test_inspect_missing_dir(tmp_path):
    _one_error_line(_cli("inspect", str(tmp_path / "nope")), "is not a directory")


def test_inspect_non_deepseek(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "llama", "hidden_size": 8, "vocab_size": 8, "num_hidden_layers": 2})
    )
    _one_error_line(_cli("inspect", str(tmp_path)), "is not a Kimi-K2.5 / DeepSeek-V3 target")


def test_layer_ids_out_of_range():
    _one_error_line(_cli("layer-ids", "1,29,60"), "has residual positions 1..60")


def test_layer_ids_duplicated():
    _one_error_line(_cli("layer-ids", "2,30,30", "--engine", "vllm"), "duplicated")


def test_export_check_on_target_dir(tiny_dir):
    _one_error_line(_cli("export-check", str(tiny_dir)), "is not ['LlamaForCausalLMEagle3']")


def test_recipe_unknown_field(tmp_path):
    from pathlib import Path

    good = Path(__file__).resolve().parents[2] / "recipes" / "tiny-k25-tp2-h200x2.yaml"
    p = tmp_path / "r.yaml"
    p.write_text(good.read_text() + "surprise: 1\n")
    _one_error_line(_cli("recipe", "validate", str(p)), "Extra inputs are not permitted")


@pytest.mark.parametrize("args,needle", [(("inspect",), "the following arguments are required")])
def test_usage_errors_exit_2(args, needle):
    res = _cli(*args)
    assert res.returncode == 2 and needle in res.stderr
