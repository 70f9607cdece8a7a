"""K2.5's INT4 routed experts in tiny checkpoints (``tiny --int4-experts``): written by compressed-tensors'
own compressor, read back (names, shapes, dequantized values) against the bf16 weights they were made
from, and every input K2.5 does not ship refused with one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specforge_kimi.errors import KimiInputError
from specforge_kimi.targets import int4
from specforge_kimi.targets.checkpoint import check_int4_shapes, inspect_target, load_text_model, weight_index
from specforge_kimi.targets.tiny import TinySpec, disk_tensor_shapes, write_tiny

SPEC = dict(
    layers=3,
    hidden=64,
    heads=4,
    experts=4,
    experts_per_token=2,
    moe_intermediate=96,
    dense_intermediate=128,
    q_lora_rank=64,
)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """The same random weights written twice: bf16 experts and INT4 experts."""
    root = tmp_path_factory.mktemp("int4")
    bf16 = write_tiny(root / "bf16", TinySpec(**SPEC), tokenizer=False)
    q = write_tiny(root / "int4", TinySpec(**SPEC, int4_experts=True), tokenizer=False)
    return bf16, q


def _tensors(d: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def test_names_shapes_and_config_are_k25s(pair):
    bf16, q = pair
    tensors = _tensors(q)
    assert {k: tuple(v.shape) for k, v in tensors.items()} == disk_tensor_shapes(TinySpec(**SPEC, int4_experts=True))
    cfg = json.loads((q / "config.json").read_text())
    assert cfg["text_config"]["quantization_config"] == int4.K25_QUANTIZATION_CONFIG
    assert "quantization_config" not in cfg  # K2.5 carries it under text_config only
    e = "language_model.model.layers.1.mlp.experts.3.down_proj."
    assert tensors[e + "weight_packed"].dtype == torch.int32 and tuple(tensors[e + "weight_packed"].shape) == (
        64,
        96 // 8,
    )
    assert tensors[e + "weight_scale"].dtype == torch.bfloat16 and tuple(tensors[e + "weight_scale"].shape) == (64, 3)
    assert tensors[e + "weight_shape"].tolist() == [64, 96]
    assert not any(k.endswith("weight_zero_point") for k in tensors)  # symmetric
    # everything but the routed experts is bf16 and byte-identical to the bf16 checkpoint
    plain = _tensors(bf16)
    for k, v in tensors.items():
        if not k.endswith(int4.PARAMS):
            assert v.dtype == torch.bfloat16 and torch.equal(v, plain[k]), k
    index = json.loads((q / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in tensors.values())


def test_the_ignore_list_keeps_exactly_the_unquantized_linears(pair):
    """compressed-tensors' own matcher, K2.5's ignore list: routed experts quantized, every other
    projection (attention, shared experts, dense MLP, lm_head, vision tower, projector) kept."""
    _, q = pair
    modules = {k.rsplit(".", 1)[0] for k in weight_index(q)}
    linears = {
        m
        for m in modules
        if m.endswith(("_proj", "_mqa", "lm_head", "wqkv", "wo", "fc0", "fc1")) or m.startswith("mm_projector.proj.")
    }
    experts = {m for m in linears if int4.EXPERT_MODULE.match(m.removeprefix("language_model."))}
    assert experts and all(not int4.is_ignored(m) for m in experts)
    assert all(int4.is_ignored(m) for m in linears - experts), sorted(
        m for m in linears - experts if not int4.is_ignored(m)
    )


def test_dequantized_values_are_the_librarys_quantization_of_the_bf16_weights(pair):
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    bf16, q = pair
    plain, packed = _tensors(bf16), _tensors(q)
    args = int4.scheme().weights
    n = 0
    for k, w in plain.items():
        module = k.removesuffix(".weight")
        if not int4.EXPERT_MODULE.match(module.removeprefix("language_model.")):
            continue
        got = int4.dequantize(module, {p: packed[f"{module}.{p}"] for p in int4.PARAMS}, tuple(w.shape))
        g = w.float().view(w.shape[0], -1, int4.GROUP_SIZE)
        scale, zp = calculate_qparams(g.amin(-1), g.amax(-1), args)
        ref = fake_quantize(w, scale.to(torch.bfloat16), zp.to(torch.int8), args)
        assert torch.equal(got, ref), module
        step = packed[f"{module}.weight_scale"].float().repeat_interleave(int4.GROUP_SIZE, dim=1)
        assert ((got.float() - w.float()).abs() <= step * 0.5 + 1e-3).all(), module  # within half a step
        n += 1
    assert n == 2 * 4 * 3


def test_readers_see_the_dequantized_experts(pair):
    bf16, q = pair
    info = inspect_target(q)
    assert info.quantization.startswith("int4 pack-quantized symmetric group 32, 24 ")
    assert inspect_target(bf16).quantization is None
    assert check_int4_shapes(q, info) == 24
    mb, mq = load_text_model(bf16), load_text_model(q)
    sb, sq = mb.state_dict(), mq.state_dict()
    differ = {k for k in sb if not torch.equal(sb[k], sq[k])}
    assert differ == {f"model.layers.{i}.mlp.experts.{p}" for i in (1, 2) for p in ("gate_up_proj", "down_proj")}
    for k in differ:  # quantization error only: small against the weights' scale (randn * 0.02)
        assert (sb[k] - sq[k]).abs().max() < 0.01


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_config(d: Path, fn) -> None:
    cfg = json.loads((d / "config.json").read_text())
    fn(cfg["text_config"]["quantization_config"])
    (d / "config.json").write_text(json.dumps(cfg))


def _edit_tensors(d: Path, fn) -> None:
    for f in d.glob("*.safetensors"):
        t = load_file(str(f))
        fn(t)
        save_file(t, str(f), metadata={"format": "pt"})
    idx = d / "model.safetensors.index.json"
    index = json.loads(idx.read_text())
    names = {}
    for f in d.glob("*.safetensors"):
        names.update({k: f.name for k in load_file(str(f))})
    index["weight_map"] = names
    idx.write_text(json.dumps(index))


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda b: b["config_groups"]["group_0"]["weights"].update(group_size=128), "weights.group_size is 128"),
        (lambda b: b["config_groups"]["group_0"]["weights"].update(num_bits=8), "weights.num_bits is 8"),
        (lambda b: b["config_groups"]["group_0"]["weights"].update(symmetric=False), "weights.symmetric is False"),
        (lambda b: b.update(format="marlin-24"), "format is 'marlin-24'"),
        (lambda b: b.update(quant_method="fp8"), "quant_method is 'fp8'"),
        (
            lambda b: b["config_groups"]["group_0"].update(
                input_activations={"num_bits": 8, "type": "float", "strategy": "tensor"}
            ),
            "quantizes activations",
        ),
    ],
)
def test_a_scheme_k25_does_not_ship_is_refused(pair, tmp_path, edit, match):
    d = _copy(pair[1], tmp_path / "bad")
    _edit_config(d, edit)
    with pytest.raises(KimiInputError, match=match) as exc:
        inspect_target(d)
    assert "\n" not in str(exc.value)


def test_missing_scales_are_refused(pair, tmp_path):
    d = _copy(pair[1], tmp_path / "noscale")
    _edit_tensors(d, lambda t: t.pop("language_model.model.layers.2.mlp.experts.1.up_proj.weight_scale", None))
    with pytest.raises(KimiInputError, match=r"experts\.1\.up_proj is INT4 without weight_scale"):
        inspect_target(d)


def test_shapes_contradicting_weight_shape_are_refused(pair, tmp_path):
    d = _copy(pair[1], tmp_path / "shape")
    key = "language_model.model.layers.1.mlp.experts.0.gate_proj.weight_shape"
    _edit_tensors(d, lambda t: t.update({key: torch.tensor([96, 32])}) if key in t else None)
    info = inspect_target(d)  # names are fine; the shapes are what is wrong
    with pytest.raises(KimiInputError, match=r"gate_proj\.weight_packed has shape \[96, 8\], weight_shape \[96, 32\]"):
        check_int4_shapes(d, info)
    with pytest.raises(KimiInputError, match=r"gate_proj\.weight_packed has shape"):
        load_text_model(d)


def test_weight_shape_against_the_config(pair, tmp_path):
    d = _copy(pair[1], tmp_path / "cfg")
    cfg = json.loads((d / "config.json").read_text())
    cfg["text_config"]["moe_intermediate_size"] = 64
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(KimiInputError, match=r"weight_shape is \[96, 64\], the config implies \[64, 64\]"):
        check_int4_shapes(d, inspect_target(d))


def test_packed_tensors_without_a_config_block_are_refused(pair, tmp_path):
    d = _copy(pair[1], tmp_path / "noblock")
    cfg = json.loads((d / "config.json").read_text())
    del cfg["text_config"]["quantization_config"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(KimiInputError, match="INT4-packed but config.json has no quantization_config"):
        inspect_target(d)


def test_tiny_refuses_a_width_the_group_size_does_not_divide_and_writes_nothing(tmp_path):
    from specforge_kimi.cli import main

    out = tmp_path / "t"
    assert main(["tiny", str(out), "--int4-experts", "--hidden", "80", "--heads", "4", "--q-lora-rank", "64"]) == 2
    assert not out.exists() and not (tmp_path / "t.partial").exists()


def test_quantize_needs_the_group_size_to_divide_the_input_width():
    with pytest.raises(KimiInputError, match="not a multiple of 32"):
        int4.quantize(torch.zeros(8, 40, dtype=torch.bfloat16))
