"""doctor: every check reports a status and, when not ok, a fix; target checks catch bad checkpoints."""

import copy
import json
import socket
from pathlib import Path

import yaml

from specforge_kimi.setup import doctor

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "tiny-k25-tp2-h200x2.yaml"


def _recipe_for(tiny_dir, tmp_path, **target):
    from conftest import TEST_SPEC

    raw = copy.deepcopy(yaml.safe_load(RECIPE.read_text()))
    raw["target"].update(
        path=str(tiny_dir),
        num_layers=TEST_SPEC["layers"],
        hidden_size=TEST_SPEC["hidden"],
        num_attention_heads=TEST_SPEC["heads"],
        aux_layer_ids=[1, 2, 3],
    )
    raw["target"].update(target)
    raw["trainer"]["draft"].update(hidden_size=TEST_SPEC["hidden"], num_attention_heads=8)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        raw["mooncake"] = {"metadata_port": s.getsockname()[1]}
    p = tmp_path / "r.yaml"
    p.write_text(yaml.safe_dump(raw))
    return p


def test_versions_match_pins_here():
    checks = {c.name: c for c in doctor.check_versions()}
    for dist in doctor.PINS:
        assert checks[f"version {dist}"].status == "ok", checks[f"version {dist}"]


PINNED = {"specforge": "0.2.0", "sglang": "0.5.14", "torch": "2.11.0+cu130", "transformers": "5.8.1"}


def test_version_checks_read_what_is_installed(monkeypatch):
    """check_versions against a stated set of installed distributions (not the probe it uses): each pin, and the
    Mooncake build(s) found handed on with the host's CUDA."""

    def run(installed: dict[str, str], cuda: str | None) -> dict[str, doctor.Check]:
        monkeypatch.setattr(doctor, "_version", installed.get)
        monkeypatch.setattr(doctor, "_torch_cuda", lambda: cuda)
        return {c.name: c for c in doctor.check_versions()}

    cpu = {**PINNED, "mooncake-transfer-engine-non-cuda": "0.3.13.post1"}
    checks = run(cpu, None)
    assert [c.status for c in checks.values()] == ["ok"] * 5
    assert (
        checks["mooncake"].detail == '{"mooncake-transfer-engine-non-cuda": "0.3.13.post1"} (CPU build, no GPUs here)'
    )
    checks = run({**cpu, "torch": "2.10.0"}, None)
    assert checks["version torch"].status == "fail" and "torch==2.11.0" in checks["version torch"].fix
    assert checks["version specforge"].status == "ok"
    checks = run(PINNED, None)  # no Mooncake at all
    assert checks["mooncake"].status == "fail" and "pip install mooncake-transfer-engine" in checks["mooncake"].fix
    checks = run({**PINNED, "mooncake-transfer-engine-cuda13": "0.3.14"}, "13.0")
    assert checks["mooncake"].status == "ok" and "CUDA 13 build" in checks["mooncake"].detail
    checks = run({**cpu, "mooncake-transfer-engine-cuda13": "0.3.14"}, "13.0")  # two builds share `mooncake`
    assert checks["mooncake"].status == "fail" and "several Mooncake builds" in checks["mooncake"].detail


def test_every_non_ok_check_has_a_fix(tiny_dir, tmp_path):
    checks = doctor.run_checks(str(_recipe_for(tiny_dir, tmp_path)))
    names = [c.name for c in checks]
    for expected in (
        "cuda",
        "sglang spec-capture patch",
        "target vs recipe",
        "target tensors",
        "mooncake master",
        "gpu budget",
        "disk",
    ):
        assert expected in names
    for c in checks:
        assert c.status in ("ok", "warn", "fail")
        if c.status != "ok":
            assert c.fix, c
    by = {c.name: c for c in checks}
    assert by["target vs recipe"].status == "ok" and by["target tensors"].status == "ok", by
    assert by["mooncake master"].status == "warn" and "mooncake_master" in by["mooncake master"].fix
    assert by["transport"].detail == "mooncake (recipe): named by the recipe (cuda_ipc would apply here too)"


def test_transport_line_names_the_choice_and_the_pool(tiny_dir, tmp_path):
    """A recipe without ``server.transport`` (auto) on one node gets cuda_ipc, and doctor says so, its pool
    included, and checks cuda_ipc's needs instead of a Mooncake master."""
    path = _recipe_for(tiny_dir, tmp_path)
    raw = yaml.safe_load(path.read_text())
    raw["server"].pop("transport")
    path.write_text(yaml.safe_dump(raw))
    by = {c.name: c for c in doctor.run_checks(str(path))}
    assert (
        by["transport"].detail.startswith("cuda_ipc (auto): one node") and "GiB pool on GPU 0" in by["transport"].detail
    )
    assert "cuda_ipc transport" in by and "mooncake master" not in by


def test_target_mismatch_is_a_failure(tiny_dir, tmp_path):
    checks = {c.name: c for c in doctor.run_checks(str(_recipe_for(tiny_dir, tmp_path, num_layers=7)))}
    assert checks["target vs recipe"].status == "fail"
    assert "num_layers: recipe 7, checkpoint 6" in checks["target vs recipe"].detail


def test_bad_recipe_reported(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text(RECIPE.read_text() + "surprise: 1\n")
    checks = doctor.run_checks(str(p))
    assert checks[-1].name == "recipe" and checks[-1].status == "fail" and "surprise" in checks[-1].detail


def test_cli_json_and_exit_code(tiny_dir, tmp_path, capsys):
    import argparse

    rc = doctor.run(argparse.Namespace(recipe=str(_recipe_for(tiny_dir, tmp_path)), json=True))
    out = json.loads(capsys.readouterr().out)
    assert rc == (1 if any(c["status"] == "fail" for c in out) else 0)


def test_cpu_mooncake_build_fails_on_a_cuda_host():
    cpu = {doctor.MOONCAKE_CPU: "0.3.13.post1"}
    c = doctor.check_mooncake_build(cpu, "13.0")
    assert c.status == "fail" and "CPU build" in c.detail
    assert "pip uninstall -y mooncake-transfer-engine-non-cuda" in c.fix
    assert "mooncake-transfer-engine-cuda13==0.3.14" in c.fix and "bootstrap.sh --gpu" in c.fix
    c12 = doctor.check_mooncake_build(cpu, "12.8")
    assert c12.status == "fail" and "'mooncake-transfer-engine==0.3.13.post1'" in c12.fix
    assert doctor.check_mooncake_build(cpu, None).status == "ok"  # a CPU host


def test_mooncake_build_must_match_torchs_cuda():
    cu13 = {"mooncake-transfer-engine-cuda13": "0.3.14"}
    assert doctor.check_mooncake_build(cu13, "13.0").status == "ok"
    wrong = doctor.check_mooncake_build(cu13, "12.8")
    assert wrong.status == "fail" and "wrong CUDA build" in wrong.detail and "mooncake-transfer-engine==" in wrong.fix
    both = doctor.check_mooncake_build({**cu13, doctor.MOONCAKE_CPU: "0.3.13.post1"}, "13.0")
    assert both.status == "fail" and "share the `mooncake` package" in both.detail
    assert doctor.check_mooncake_build({}, "13.0").status == "fail"
    assert doctor.check_mooncake_build(cu13, None).status == "warn"


def test_mooncake_pins_are_pyprojects_extras():
    import tomllib

    extras = tomllib.loads((RECIPE.parents[1] / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for name, pin, extra in doctor.MOONCAKE_FOR_CUDA.values():
        assert extras[extra] == [f"{name}=={pin}"]
    assert extras["cpu"] == [doctor.MOONCAKE_CPU]


def test_tracking_package_checked(tmp_path, monkeypatch):
    from specforge_kimi.plan.run_plan import load_recipe

    recipe = load_recipe(RECIPE)
    assert recipe.tracking.report_to == "tensorboard"
    (c,) = doctor.check_tracking(recipe)
    assert c.status == "ok" and c.detail.endswith(f"({recipe.output_dir}/runs)")  # tensorboard ships with SpecForge
    raw = yaml.safe_load(RECIPE.read_text())
    raw["tracking"] = {"report_to": "swanlab"}
    p = tmp_path / "r.yaml"
    p.write_text(yaml.safe_dump(raw))
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "swanlab" else real(name, *a))
    (c,) = doctor.check_tracking(load_recipe(p))
    assert c.status == "fail" and "pip install swanlab" in c.fix and "report_to: none" in c.fix


def test_mooncake_listeners_off_loopback_are_named(tiny_dir, tmp_path):
    """The listeners Mooncake binds to every address (tests/integration/test_loopback_listeners.py asserts them on
    a real run) are a warning with the transfer engine's own log line and the metadata port."""
    recipe = _recipe_for(tiny_dir, tmp_path)
    by = {c.name: c for c in doctor.run_checks(str(recipe))}
    c = by["mooncake listeners"]
    assert c.status == "warn" and c.fix
    assert "Transfer Engine RPC using new RPC mapping, listening on <address>:<port>" in c.detail
    from specforge_kimi.plan.run_plan import load_recipe

    assert f"port {load_recipe(str(recipe)).mooncake.metadata_port}" in c.detail


DFLASH_RECIPE = RECIPE.parent / "tiny-k25-tp1-h200-dflash.yaml"


def _block_recipe_for(tiny_dir, tmp_path, *, num_layers=6, ids=(1, 2, 3, 4)):
    """The tiny DFlash recipe on the CPU tiny target (6 layers, hidden 64); ``num_layers`` and ``ids`` as the
    recipe states them (the checkpoint keeps its 6)."""
    from conftest import TEST_SPEC

    raw = copy.deepcopy(yaml.safe_load(DFLASH_RECIPE.read_text()))
    raw["target"].update(path=str(tiny_dir), num_layers=num_layers, hidden_size=TEST_SPEC["hidden"])
    raw["trainer"]["draft"].update(hidden_size=TEST_SPEC["hidden"], num_target_layers=num_layers)
    raw["trainer"]["draft"]["dflash_config"]["target_layer_ids"] = list(ids)
    p = tmp_path / f"block-{num_layers}.yaml"
    p.write_text(yaml.safe_dump(raw))
    return p


def test_block_recipe_ids_against_the_checkpoint(tiny_dir, tmp_path):
    """A block recipe's DFlash ids are read against the checkpoint's num_hidden_layers: ids + 1 as positions when
    they fit; an id the 6-layer checkpoint never captures (a recipe written for 8 layers) and a draft's
    num_target_layers off the checkpoint are failures with a fix. An EAGLE-3 recipe gets no such check."""
    by = {c.name: c for c in doctor.run_checks(str(_block_recipe_for(tiny_dir, tmp_path)))}
    assert by["block draft ids"].status == "ok", by["block draft ids"]
    assert by["block draft ids"].detail == "DFlash ids [1, 2, 3, 4] -> captured positions [2, 3, 4, 5] of 6 layers"
    assert by["target vs recipe"].status == "ok"
    assert {"sglang dflash capture", "sglang DFLASH"} <= set(by)

    by = {c.name: c for c in doctor.run_checks(str(_block_recipe_for(tiny_dir, tmp_path, num_layers=8, ids=(1, 5))))}
    c = by["block draft ids"]
    assert c.status == "fail" and "include 5" in c.detail and "0..4" in c.detail and c.fix, c

    by = {c.name: c for c in doctor.run_checks(str(_block_recipe_for(tiny_dir, tmp_path, num_layers=8)))}
    c = by["block draft ids"]
    assert c.status == "fail" and "num_target_layers is 8, the checkpoint has 6" in c.detail, c

    assert "block draft ids" not in {c.name for c in doctor.run_checks(str(_recipe_for(tiny_dir, tmp_path)))}


def _capture_patch_part(specforge_checkout, rels) -> str:
    """The hunks of SpecForge's SGLang spec-capture patch for the files ``rels`` (under ``sglang/``)."""
    from specforge_kimi.setup.setup_patches import CAPTURE_PATCH

    text = (specforge_checkout / CAPTURE_PATCH).read_text()
    parts = ["diff --git" + p for p in text.split("diff --git")[1:]]
    return "".join(p for p in parts if any(f"b/python/sglang/{rel}\n" in p for rel in rels))


def _sglang_copy(dest: Path, rels, patch_text: str | None, reverse: bool = False) -> Path:
    """The installed SGLang's files ``rels`` copied under ``dest/sglang/``, then ``patch_text`` applied (-p2)."""
    import shutil
    import subprocess

    from specforge_kimi.setup.setup_patches import sglang_root

    for rel in rels:
        (dest / "sglang" / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(sglang_root() / "sglang" / rel, dest / "sglang" / rel)
    if patch_text:
        args = ["patch", "-p2", "-d", str(dest), "--batch", "--fuzz=0", "-f"] + (["-R"] if reverse else [])
        res = subprocess.run(args, input=patch_text, capture_output=True, text=True)
        assert res.returncode == 0, res.stdout + res.stderr
    return dest


def test_block_sglang_capture_method_and_dflash(specforge_checkout, tmp_path):
    """The installed SGLang's capture code carries the dflash capture method exactly when SpecForge's spec-capture
    patch is in it (read from the patch's own hunks, applied to copies of the pinned SGLang's files), and SGLang has
    DFLASH (its enum, block-size flag and draft model); DSpark is a warning (no DSpark heads to serve)."""
    rels = list(doctor.DFLASH_CAPTURE_MARKS)
    part = _capture_patch_part(specforge_checkout, rels)
    assert part.count("diff --git") == 2
    serve = [r for r in doctor.DFLASH_SERVE_MARKS if r not in rels]
    patched = _sglang_copy(tmp_path / "patched", rels + serve, None)
    if doctor.DFLASH_CAPTURE_MARKS["srt/server_args.py"] not in (patched / "sglang/srt/server_args.py").read_text():
        _sglang_copy(tmp_path / "patched", rels, part)
        plain = _sglang_copy(tmp_path / "plain", rels + serve, None)
    else:  # this SGLang is set up: take the patch back out for the plain copy
        plain = _sglang_copy(tmp_path / "plain", rels + serve, part, reverse=True)

    capture, dflash = doctor.check_block_sglang("dflash", patched)
    assert capture.name == "sglang dflash capture" and capture.status == "ok", capture
    assert dflash.name == "sglang DFLASH" and dflash.status == "ok", dflash

    capture, dflash = doctor.check_block_sglang("dflash", plain)
    assert capture.status == "fail" and capture.fix.startswith("specforge-kimi setup --specforge-checkout"), capture
    assert "server_args.py has no 'spec_capture_method'" in capture.detail and "model_runner.py" in capture.detail
    assert dflash.status == "ok"

    (patched / "sglang/srt/models/dflash.py").unlink()
    capture, dflash = doctor.check_block_sglang("dflash", patched)
    assert capture.status == "ok" and dflash.status == "fail" and "models/dflash.py is missing" in dflash.detail

    _sglang_copy(tmp_path / "patched", ["srt/models/dflash.py"], None)
    _capture, dflash = doctor.check_block_sglang("dspark", patched)
    assert dflash.status == "warn" and "no DSpark heads" in dflash.detail and "dflash" in dflash.fix


def test_block_recipe_asks_for_no_eagle3_patch(monkeypatch):
    """Our eagle3-only SpecForge patches (the eagle3 step's switches) not applied: a warning with a fix for an
    EAGLE-3 recipe, fine for a block draft; the patches both read (the optimizer's) stay a warning for both."""
    from specforge_kimi.setup import setup_patches
    from specforge_kimi.setup.setup_patches import KNOWN_PATCHES, PatchStatus

    assert doctor.eagle3_step_patches() == {
        "eagle3-keep-allocator-cache",
        "eagle3-fewer-host-syncs",
        "eagle3-chunked-head-loss",
    }
    fake = [
        PatchStatus(Path(f"000{i}-{n}.patch"), Path("/nowhere"), 1, "applicable", [])
        for i, n in enumerate(KNOWN_PATCHES["specforge"])
    ]
    monkeypatch.setattr(setup_patches, "plan", lambda *a, **k: fake)

    def by(family):
        return {
            c.name[len("specforge patch ") :]: c
            for c in doctor.check_patches(family)
            if c.name.startswith("specforge patch ")
        }

    eagle3, block = by("eagle3"), by("dflash")
    for name in KNOWN_PATCHES["specforge"]:
        assert eagle3[name].status == "warn" and eagle3[name].fix
        if name in doctor.eagle3_step_patches():
            assert block[name].status == "ok" and not block[name].fix and "not needed" in block[name].detail
        else:
            assert block[name].status == "warn", block[name]


def test_gpu_budget_replans_the_split_on_a_smaller_card():
    """Free memory below gpus.memory_gib is not failed outright: the recipe's split is planned again at the card's
    free memory. The tiny H200 recipe still fits an H100's ~79 GiB (a warning naming the figure to plan with); the
    K2.5-width slice does not (a failure naming what no longer fits); a card with the recipe's memory is ok."""
    from specforge_kimi.plan.run_plan import load_recipe

    repo = Path(__file__).resolve().parents[2]
    tiny = load_recipe(repo / "recipes/tiny-k25-tp1-h200.yaml")
    slice_ = load_recipe(repo / "recipes/kimi-k25-slice-h200.yaml")
    c = doctor.budget_check(tiny, [79.2])
    assert c.status == "warn" and "still fits at 79.2 GiB" in c.detail and "server pool 23.76 GiB" in c.detail
    assert c.fix.startswith("set gpus.memory_gib: 79.2")
    c = doctor.budget_check(slice_, [79.2])
    assert c.status == "fail" and "server needs 41.9 GiB weights" in c.detail and "0.36 x 79.2 GiB" in c.detail
    assert "until recipe validate passes" in c.fix
    assert doctor.budget_check(slice_, [139.0]).status == "ok"
    c = doctor.budget_check(tiny, [139.0, 10.0])  # the smallest free GPU decides
    assert c.status == "fail" and "GPU 1: 10.0 GiB free" in c.detail and "GPU 0" not in c.detail
    assert "trainer peak ~8.3 GiB > 7.0 GiB" in c.detail


def test_disk_check_against_the_output_dirs_free_space():
    """ok with the estimate and the free space when the run's checkpoints and export fit; a failure naming both, with
    the fixes, when they do not; measured on the output_dir's filesystem when no figure is given."""
    from specforge_kimi.plan import disk
    from specforge_kimi.plan.run_plan import load_recipe

    recipe = load_recipe(Path(__file__).resolve().parents[2] / "recipes/kimi-k25-slice-h200.yaml")
    need = disk.run_disk_bytes(recipe)
    c = doctor.disk_check(recipe, need)
    assert c.status == "ok" and disk.estimate(recipe) in c.detail and f"{need / 1e9:.1f} GB free" in c.detail
    c = doctor.disk_check(recipe, need - 1)
    assert c.status == "fail" and disk.estimate(recipe) in c.detail and " free" in c.detail
    assert "trainer.save_interval" in c.fix and "trainer.max_checkpoints" in c.fix
    assert doctor.disk_check(recipe).status == ("ok" if disk.free_bytes(recipe.output_dir) >= need else "fail")
