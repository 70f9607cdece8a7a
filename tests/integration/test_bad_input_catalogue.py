"""The bad-input catalogue: each case gives one `error:` line naming the cause, exit code != 0,
and leaves no partial output behind. One row per case, across our commands."""

import json
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
TINY_RECIPE = ROOT / "recipes" / "tiny-k25-tp2-h200x2.yaml"
GOOD_ROW = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}


def _recipe(tmp, mutate):
    raw = yaml.safe_load(TINY_RECIPE.read_text())
    mutate(raw)
    p = tmp / "recipe.yaml"
    p.write_text(yaml.safe_dump(raw))
    return str(p)


def _jsonl(tmp, name, lines):
    p = tmp / name
    p.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in lines))
    return str(p)


def _copy_tiny(tiny_dir, tmp, edit=None, drop_weights=False):
    out = tmp / "ckpt"
    shutil.copytree(tiny_dir, out)
    if drop_weights:
        for f in out.glob("*.safetensors*"):
            f.unlink()
    if edit:
        cfg = json.loads((out / "config.json").read_text())
        edit(cfg)
        (out / "config.json").write_text(json.dumps(cfg))
    return str(out)


def _launchable_recipe(tmp, tiny_dir, mutate=None):
    """The tiny recipe on the session's tiny target with prepared data: `launch` gets past its input check."""
    from conftest import TEST_SPEC, prepare_corpus

    data = prepare_corpus(tmp, 4, "--standin-tokenizer")

    def edit(r):
        r["output_dir"] = str(tmp / "run")
        r["target"].update(
            path=str(tiny_dir),
            num_layers=TEST_SPEC["layers"],
            hidden_size=TEST_SPEC["hidden"],
            num_attention_heads=TEST_SPEC["heads"],
            aux_layer_ids=[1, 3, 4],
        )
        r["gpus"]["per_node"] = 1
        r["trainer"]["draft"].update(
            hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=4, draft_vocab_size=256
        )
        r["trainer"]["max_length"] = 256
        r["data"] = {"prompts_path": str(data / "prompts.jsonl"), "vocab_mapping_path": str(data / "vocab_mapping.pt")}
        if mutate:
            mutate(r)

    return _recipe(tmp, edit)


def _busy_port_recipe(tmp, tiny_dir):
    from specforge_kimi.run.services import free_ports

    s = socket.socket()
    s.bind(("127.0.0.1", free_ports(1)[0]))  # a port recipes accept (<= MAX_SERVER_PORT)
    s.listen()
    _busy_port_recipe.sock = s  # keep it bound for the test's lifetime
    port = s.getsockname()[1]
    return _launchable_recipe(tmp, tiny_dir, lambda r: r["server"].update(port=port))


def _earlier_launch_recipe(tmp, tiny_dir):
    recipe = _launchable_recipe(tmp, tiny_dir)
    (tmp / "run" / "supervisor").mkdir(parents=True)  # what an interrupted launch leaves
    return recipe


CASES = {
    # name: (argv builder(tmp, tiny_dir) -> list[str], expected text in the error line, path that must not exist)
    "prepare: malformed JSONL": (
        lambda t, d: [
            "prepare",
            _jsonl(t, "in.jsonl", [GOOD_ROW, "{not json"]),
            "--out",
            str(t / "o"),
            "--standin-tokenizer",
            "--on-error",
            "fail",
        ],
        "in.jsonl:2: invalid JSON",
        "o",
    ),
    "prepare: empty file": (
        lambda t, d: ["prepare", _jsonl(t, "in.jsonl", []), "--out", str(t / "o"), "--standin-tokenizer"],
        "is empty (no JSONL lines)",
        "o",
    ),
    "prepare: empty conversation": (
        lambda t, d: [
            "prepare",
            _jsonl(t, "in.jsonl", [{"messages": []}]),
            "--out",
            str(t / "o"),
            "--standin-tokenizer",
            "--on-error",
            "fail",
        ],
        "must be a non-empty list",
        "o",
    ),
    "prepare: no assistant turn": (
        lambda t, d: [
            "prepare",
            _jsonl(t, "in.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}]),
            "--out",
            str(t / "o"),
            "--standin-tokenizer",
        ],
        "no_assistant_turn",
        "o",
    ),
    "prepare: over-length rows": (
        lambda t, d: [
            "prepare",
            _jsonl(t, "in.jsonl", [GOOD_ROW]),
            "--out",
            str(t / "o"),
            "--standin-tokenizer",
            "--max-length",
            "8",
        ],
        "no training rows survived",
        "o",
    ),
    "prepare: missing input": (
        lambda t, d: ["prepare", str(t / "nope.jsonl"), "--out", str(t / "o"), "--standin-tokenizer"],
        "nope.jsonl",
        "o",
    ),
    "prepare: tokenizer dir missing": (
        lambda t, d: [
            "prepare",
            _jsonl(t, "in.jsonl", [GOOD_ROW]),
            "--out",
            str(t / "o"),
            "--tokenizer",
            str(t / "no-tok"),
        ],
        "no-tok",
        "o",
    ),
    "regenerate: unreachable server": (
        lambda t, d: [
            "regenerate",
            _jsonl(t, "in.jsonl", [GOOD_ROW]),
            "--server",
            "http://127.0.0.1:9",
            "--out",
            str(t / "o.jsonl"),
            "--max-retries",
            "0",
        ],
        "127.0.0.1:9",
        None,
    ),
    "tiny: vocab too small": (lambda t, d: ["tiny", str(t / "o"), "--vocab", "1000"], "special ids", "o"),
    "tiny: zero layers": (lambda t, d: ["tiny", str(t / "o"), "--layers", "1"], "--layers must be >= 2", "o"),
    "inspect: missing checkpoint": (lambda t, d: ["inspect", str(t / "nope")], "is not a directory", None),
    "inspect: no safetensors": (
        lambda t, d: ["inspect", _copy_tiny(d, t, drop_weights=True)],
        "no *.safetensors",
        None,
    ),
    "inspect: non-DeepSeek config": (
        lambda t, d: [
            "inspect",
            _copy_tiny(
                d,
                t,
                edit=lambda c: (
                    c.update(model_type="llama", architectures=["LlamaForCausalLM"])
                    or c.pop("text_config")
                    or c.update(hidden_size=64, vocab_size=163840, num_hidden_layers=6)
                ),
            ),
        ],
        "not a Kimi-K2.5 / DeepSeek-V3 target",
        None,
    ),
    "inspect: wrapper without text_config": (
        lambda t, d: ["inspect", _copy_tiny(d, t, edit=lambda c: c.pop("text_config"))],
        "must carry a text_config",
        None,
    ),
    "inspect: shapes contradict config": (
        lambda t, d: ["inspect", _copy_tiny(d, t, edit=lambda c: c["text_config"].update(hidden_size=128))],
        "but the config says",
        None,
    ),
    "layer-ids: out of range": (lambda t, d: ["layer-ids", "1,29,60"], "has residual positions 1..60", None),
    "layer-ids: duplicated": (lambda t, d: ["layer-ids", "2,30,30", "--engine", "vllm"], "duplicated", None),
    "layer-ids: embedding output": (
        lambda t, d: ["layer-ids", "0,30,58", "--engine", "vllm"],
        "embedding output",
        None,
    ),
    "layer-ids: not a number": (lambda t, d: ["layer-ids", "1,x"], "must be integers, got 'x'", None),
    "train: SpecForge config fails its schema": (
        lambda t, d: ["train", "-c", _jsonl(t, "run.yaml", ["run_id: x", "surprise: 1"])],
        "SpecForge run config: model: Field required",
        None,
    ),
    "recipe: misspelt required key": (
        lambda t, d: [
            "recipe",
            "validate",
            _recipe(t, lambda r: r["trainer"].update(learning_rat=r["trainer"].pop("learning_rate"))),
        ],
        "trainer.learning_rate: Field required; trainer.learning_rat: Extra inputs",
        None,
    ),
    "eval-draft: aux ids not numbers": (
        lambda t, d: [
            "eval-draft",
            "--target",
            str(d),
            "--draft-config",
            str(t / "c.json"),
            "--vocab-mapping",
            str(t / "v.pt"),
            "--aux-ids",
            "1,x",
        ],
        "must be integers, got 'x'",
        None,
    ),
    "train-offline: no feature files": (
        lambda t, d: [
            "train-offline",
            str(TINY_RECIPE),
            "--features",
            str((t / "feats").mkdir() or t / "feats"),
            "--out",
            str(t / "o"),
        ],
        "holds no .ckpt",
        "o",
    ),
    "recipe: unknown field": (
        lambda t, d: ["recipe", "validate", _recipe(t, lambda r: r.update(surprise=1))],
        "Extra inputs are not permitted",
        None,
    ),
    "recipe: TP does not divide heads": (
        lambda t, d: ["recipe", "validate", _recipe(t, lambda r: r["target"].update(num_attention_heads=7))],
        "does not divide num_attention_heads",
        None,
    ),
    "recipe: aux ids invalid": (
        lambda t, d: ["recipe", "validate", _recipe(t, lambda r: r["target"].update(aux_layer_ids=[3, 2, 1]))],
        "not ascending",
        None,
    ),
    "recipe: memory split does not fit": (
        lambda t, d: ["recipe", "validate", _recipe(t, lambda r: r["server"].update(mem_fraction_static=0.99))],
        "memory split does not fit",
        None,
    ),
    "recipe: cuda_ipc across nodes": (
        lambda t, d: [
            "recipe",
            "validate",
            _recipe(
                t,
                lambda r: (
                    r["server"].update(transport="cuda_ipc", host="10.0.0.1"),
                    r["gpus"].update(nnodes=2),
                    r["trainer"].update(consumer_state_dir="/local/state"),
                ),
            ),
        ],
        "cuda_ipc is single-node",
        None,
    ),
    "recipe: cuda_ipc with server restarts": (
        lambda t, d: [
            "recipe",
            "validate",
            _recipe(
                t, lambda r: (r["server"].update(transport="cuda_ipc"), r.update(resilience={"server_restarts": 2}))
            ),
        ],
        "cannot restart a lost capture server",
        None,
    ),
    "export-check: not a draft": (lambda t, d: ["export-check", str(d)], "LlamaForCausalLMEagle3", None),
    "launch: port already taken": (lambda t, d: ["launch", _busy_port_recipe(t, d)], "is already in use", "run/logs"),
    "launch: the recipe's data files are missing": (
        lambda t, d: ["launch", _recipe(t, lambda r: r.update(output_dir=str(t / "run")))],
        "data.prompts_path",
        "run",
    ),
    "launch: an earlier launch's run dir, without --resume": (
        lambda t, d: ["launch", _earlier_launch_recipe(t, d)],
        "launch RECIPE --resume",
        "run/logs",
    ),
    "launch --resume: nothing to resume": (
        lambda t, d: ["launch", _launchable_recipe(t, d), "--resume"],
        "launch it without --resume",
        "run/logs",
    ),
    "recipe validate --check-files: prompts tokenized for another model": (
        lambda t, d: [
            "recipe",
            "validate",
            _launchable_recipe(
                t,
                d,
                lambda r: r["data"].update(prompts_path=_jsonl(t, "p.jsonl", [{"input_ids": [9], "loss_mask": [1]}])),
            ),
            "--check-files",
        ],
        "was not rendered with K2.5's chat template",
        None,
    ),
    "setup: not a SpecForge checkout": (
        lambda t, d: ["setup", "--specforge-checkout", str(t)],
        "is not a SpecForge checkout",
        None,
    ),
    "bench: a flag the recipe fixes beside --recipe": (
        lambda t, d: ["bench", "--recipe", str(TINY_RECIPE), "--draft", str(t / "draft"), "--config", "3,1,4"],
        "--config does not apply with --recipe: the recipe's bench section sets the speculative config",
        "runs",
    ),
}


def test_catalogue_size():
    assert len(CASES) >= 20


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input(name, tmp_path, tiny_dir):
    build, needle, must_not_exist = CASES[name]
    argv = build(tmp_path, tiny_dir)
    res = subprocess.run(
        [sys.executable, "-m", "specforge_kimi", *argv], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert res.returncode != 0, (name, res.stdout[-500:])
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert lines and lines[-1].startswith("error: "), (name, res.stderr[-1500:])
    assert needle in lines[-1], (name, lines[-1])
    assert "Traceback" not in res.stderr, res.stderr[-2000:]
    if must_not_exist:
        assert not (tmp_path / must_not_exist).exists(), f"{name}: partial output {must_not_exist} left behind"
