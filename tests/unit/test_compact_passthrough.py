"""Our SpecForge patch compact-capture-passthrough against the pinned wheel.

Scope: the producer side. With ``SPECFORGE_SPEC_CAPTURE_COMPACT=1`` the patched
``SGLangServerCaptureAdapter._spec_capture_payload`` sends input_ids as ``source: input_ids``, a
one-valued list as ``fill`` and any other as base64 bytes of the smallest integer type; every form
rebuilds the exact tensor SpecForge's JSON list gives (checked through the reference server's
``passthrough_tensor``, the CPU stand-in of SGLang patch spec-capture-compact-passthrough, whose own sink is tested byte-exact
in ``test_sglang_patches.py``). Without the variable the payload is SpecForge's, unchanged.
"""

from __future__ import annotations

import types

import pytest
import torch

from specforge_kimi.servers.reference_server import passthrough_tensor
from specforge_kimi.setup import setup_patches

FILE = "specforge/inference/adapters/server_capture.py"


@pytest.fixture(scope="module")
def patched(tmp_path_factory):
    """The wheel's server_capture.py as ``specforge-kimi setup`` leaves it (on a copy), as a module."""
    return setup_patches.load_patched_specforge_module(FILE, tmp_path_factory.mktemp("sf"))


def _adapter(module, input_adapter=None):
    """Just what ``_spec_capture_payload`` reads of an adapter: SpecForge's eagle3 passthrough."""
    schema = module.ServerCaptureSchema(
        aux_feature="hidden_state",
        last_hidden_feature="target",
        passthrough=(("input_ids", "input_ids", ()), ("loss_mask", "loss_mask", ()), ("pos", "pos", ())),
        attention_mask_feature="attention_mask",
    )
    this = types.SimpleNamespace(
        schema=schema, store=types.SimpleNamespace(store_id="s"), run_id="r", request_input_adapter=input_adapter
    )
    this._sample_id = lambda task: f"r:{task.task_id}"
    return this


def _task(payload):
    return types.SimpleNamespace(task_id="t0", attempt=0, payload=payload)


@pytest.mark.parametrize(
    "pos",
    [list(range(7)), [5] * 7, [70_000 + i for i in range(7)], [-3, 2**40, 0, 1, 2, 3, 4]],
    ids=["uint8", "fill", "int32", "int64"],
)
def test_compact_payload_rebuilds_the_same_tensors(patched, monkeypatch, pos):
    ids = [163_000, 5, 17, 99_999, 0, 1, 2]
    payload = {"input_ids": ids, "loss_mask": [0, 0, 1, 1, 1, 0, 1], "pos": pos}
    adapter = _adapter(patched)
    monkeypatch.delenv("SPECFORGE_SPEC_CAPTURE_COMPACT", raising=False)
    lists = patched.SGLangServerCaptureAdapter._spec_capture_payload(adapter, _task(payload))
    monkeypatch.setenv("SPECFORGE_SPEC_CAPTURE_COMPACT", "1")
    compact = patched.SGLangServerCaptureAdapter._spec_capture_payload(adapter, _task(payload))
    assert {k: v for k, v in lists.items() if k != "passthrough"} == {
        k: v for k, v in compact.items() if k != "passthrough"
    }
    assert all("data" in i for i in lists["passthrough"])  # the variable off: SpecForge's payload
    assert all("data" not in i for i in compact["passthrough"])
    by = {i["name"]: i for i in compact["passthrough"]}
    assert by["input_ids"]["source"] == "input_ids" and by["attention_mask"]["fill"] == 1
    assert by["loss_mask"]["data_dtype"] == "uint8"
    want_pos = {"uint8": "uint8", "fill": None, "int32": "int32", "int64": "int64"}
    kind = (
        "fill"
        if len(set(pos)) == 1
        else ("uint8" if max(pos) < 256 and min(pos) >= 0 else "int32" if max(pos) < 2**31 else "int64")
    )
    assert by["pos"].get("data_dtype") == want_pos[kind] and (kind != "fill" or by["pos"]["fill"] == 5)
    for full, small in zip(lists["passthrough"], compact["passthrough"], strict=False):
        assert full["name"] == small["name"] and full["shape"] == small["shape"]
        assert torch.equal(passthrough_tensor(small, ids), passthrough_tensor(full, ids)), full["name"]


def test_input_adapter_keeps_input_ids_in_the_payload(patched, monkeypatch):
    """With a request input adapter the request body's model inputs are not the task's input_ids,
    so the ids travel as bytes, not as a reference to the request."""
    ids = [1, 2, 300]
    monkeypatch.setenv("SPECFORGE_SPEC_CAPTURE_COMPACT", "1")
    payload = patched.SGLangServerCaptureAdapter._spec_capture_payload(
        _adapter(patched, input_adapter=object()), _task({"input_ids": ids, "loss_mask": [1, 1, 1], "pos": [0, 1, 2]})
    )
    item = payload["passthrough"][0]
    assert "source" not in item and item["data_dtype"] == "int32"
    assert passthrough_tensor(item, [9, 9, 9]).tolist() == [ids]


def test_reference_server_refuses_unknown_forms():
    with pytest.raises(ValueError, match="unknown source"):
        passthrough_tensor({"name": "x", "source": "labels", "shape": [1, 1]}, [1])
    with pytest.raises(ValueError, match="none of data"):
        passthrough_tensor({"name": "x", "shape": [1, 1]}, [1])
    with pytest.raises(ValueError, match="unsupported data_dtype"):
        passthrough_tensor({"name": "x", "data_b64": "AA==", "data_dtype": "bool", "shape": [1, 1]}, [1])


def test_passthrough_cpu_bench_compares_equal_tensors(tmp_path):
    """``bench/studies/passthrough_cpu.py`` builds both bodies through the patched producer and checks the
    sink gets identical tensors from them (its timings are not asserted)."""
    import importlib.util as iu
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench" / "studies" / "passthrough_cpu.py"
    spec = iu.spec_from_file_location("bench_passthrough_cpu", path)
    mod = iu.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "p.json"
    assert mod.main(["--shapes", "3x40,2x64", "--reps", "1", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["command"] and res["environment"]["cpu_count"]
    for s in res["shapes"]:
        assert s["identical_tensors"] is True
        assert s["lists"]["passthrough_items"] == ["data"]
        assert s["compact"]["passthrough_items"] == ["data_b64", "fill", "source"]
        assert s["compact"]["body_bytes"] < s["lists"]["body_bytes"]


def test_producer_body_sets_the_variable_for_the_call_only(patched, monkeypatch):
    """``capture_features.producer_body``: the payload builder sees the variable as asked, and the
    caller's environment is as it was afterwards."""
    import os

    from specforge_kimi.run.offline_twin import producer_body
    from specforge_kimi.servers.capture_server import COMPACT_PASSTHROUGH_ENV

    adapter = _adapter(patched)
    adapter._request_inputs = lambda tasks: {"input_ids": [list(t.payload["input_ids"]) for t in tasks]}
    adapter._spec_capture_payload = lambda t: patched.SGLangServerCaptureAdapter._spec_capture_payload(adapter, t)
    task = _task({"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1], "pos": [4, 4, 4]})
    monkeypatch.setenv(COMPACT_PASSTHROUGH_ENV, "0")
    compact = producer_body(adapter, [task], compact=True)
    assert os.environ[COMPACT_PASSTHROUGH_ENV] == "0"
    lists = producer_body(adapter, [task], compact=False)
    assert os.environ[COMPACT_PASSTHROUGH_ENV] == "0"
    assert all("data" not in i for i in compact["spec_capture"][0]["passthrough"])
    assert all("data" in i for i in lists["spec_capture"][0]["passthrough"])
    assert lists["input_ids"] == [[1, 2, 3]] and lists["sampling_params"]["max_new_tokens"] == 1


def _unpatched_specforge(dest):
    """The installed wheel's FILE under ``dest`` as SpecForge ships it: copied, and SpecForge patch compact-capture-passthrough taken back out
    when ``specforge-kimi setup`` had applied it there (so these tests do not depend on the venv's state)."""
    from conftest import specforge_as_shipped

    specforge_as_shipped(setup_patches._scratch_copy(setup_patches.specforge_root(None), [FILE], dest))
    patch = setup_patches.patch_file("specforge", setup_patches.COMPACT_SPECFORGE_PATCH)
    assert setup_patches.classify(patch, dest, 1).state == "applicable"
    return dest


def test_compact_gaps_name_each_missing_half(tmp_path):
    """``compact_passthrough_gaps`` names SpecForge patch compact-capture-passthrough on the wheel as
    shipped and stops naming it on a copy ``setup`` patched; SGLang patch spec-capture-compact-passthrough is named on
    an sglang tree without the capture stack."""
    sf_site = _unpatched_specforge(tmp_path / "wheel")
    sg_site = tmp_path / "sglang-without-capture"
    sg_site.mkdir()
    gaps = setup_patches.compact_passthrough_gaps(specforge_site=sf_site, sglang_site=sg_site)
    assert any(g.startswith("SpecForge patch compact-capture-passthrough is not applied") for g in gaps), gaps
    assert any(g.startswith("SGLang patch spec-capture-compact-passthrough is not applied") for g in gaps), gaps
    setup_patches.load_patched_specforge_module(FILE, tmp_path / "patched")  # patches the copy there
    gaps = setup_patches.compact_passthrough_gaps(specforge_site=tmp_path / "patched", sglang_site=sg_site)
    assert not any(g.startswith("SpecForge patch compact-capture-passthrough ") for g in gaps), gaps
    assert any(g.startswith("SGLang patch spec-capture-compact-passthrough ") for g in gaps), gaps


def test_launch_refuses_compact_without_its_patches(tmp_path, monkeypatch):
    """A launch plan with ``server.compact_passthrough`` on stops in preflight, naming the missing patches
    and both ways out; with it off the check does not run. The installed trees are stood in for by the
    wheel as shipped and an sglang without the capture stack, whatever ``setup`` did to this venv."""
    import sys
    from pathlib import Path

    import yaml

    from specforge_kimi.errors import KimiInputError
    from specforge_kimi.plan.recipes import Recipe
    from specforge_kimi.plan.run_plan import compile_plan
    from specforge_kimi.run.launch import build_colocated_plan, compact_preflight

    wheel = _unpatched_specforge(tmp_path / "wheel")
    (tmp_path / "sglang").mkdir()
    monkeypatch.setattr(setup_patches, "specforge_root", lambda checkout: wheel)
    monkeypatch.setattr(setup_patches, "sglang_root", lambda: tmp_path / "sglang")
    raw = yaml.safe_load((Path(__file__).resolve().parents[2] / "recipes" / "tiny-k25-tp1-h200.yaml").read_text())
    raw["output_dir"] = str(tmp_path / "run")
    assert Recipe.model_validate(raw).server.compact_passthrough  # the recipes keep the default: on
    for on in (True, False):
        raw["server"]["compact_passthrough"] = on
        recipe = Recipe.model_validate(raw)
        plan = build_colocated_plan(compile_plan(recipe, rendered_dir=tmp_path / f"r{on}"), python=sys.executable)
        if on:
            with pytest.raises(KimiInputError) as e:
                compact_preflight(plan)
            msg = str(e.value)
            assert "server.compact_passthrough is on" in msg and "SpecForge patch compact-capture-passthrough" in msg
            assert "specforge-kimi setup" in msg and "server.compact_passthrough: false" in msg
        else:
            compact_preflight(plan)
