"""K2.5's INT4 routed experts: compressed-tensors ``pack-quantized``, int4 symmetric, group 32.

Scope: the format Kimi-K2.5 ships (and K2-Thinking before it): every routed-expert projection
``...mlp.experts.E.{gate,up,down}_proj`` is stored as ``weight_packed`` (int32 [out, in/8], eight
4-bit values per word along the input dimension), ``weight_scale`` (bf16 [out, in/32], one scale
per group of 32 inputs, no zero point) and ``weight_shape`` (int [2] = [out, in]); everything the
config's ``ignore`` list names (attention, shared experts, the dense layer's MLP, ``lm_head``, the
vision tower and projector) stays bf16, and the router (``mlp.gate``) is not a Linear. The
``quantization_config`` block sits under ``text_config`` (SGLang 0.5.14's ``KimiK25Config`` copies
it up; transformers' ``from_pretrained`` does not decompress fused DeepSeek-V3 experts, so our
readers dequantize first).

Quantizing and dequantizing go through the ``compressed-tensors`` library itself
(``calculate_qparams`` + ``PackedQuantizationCompressor``), never a hand-written packer, so the
tensors are exactly what the library, SGLang's ``CompressedTensorsWNA16MoE`` loader and vLLM read.
Any other scheme (another bit width, group size, asymmetric, activation quantization, another
format) is refused with one line: K2.5 does not ship it and nothing here was checked against it.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from typing import Any

from specforge_kimi.errors import KimiInputError

#: K2.5's ``text_config.quantization_config``, verbatim (Moonshot's K2.5 config as reproduced by
#: SGLang/vLLM test fixtures; K2-Thinking's block differs only in the ignore list and sits at top level).
K25_QUANTIZATION_CONFIG: dict[str, Any] = {
    "config_groups": {
        "group_0": {
            "input_activations": None,
            "output_activations": None,
            "targets": ["Linear"],
            "weights": {
                "actorder": None,
                "block_structure": None,
                "dynamic": False,
                "group_size": 32,
                "num_bits": 4,
                "observer": "minmax",
                "observer_kwargs": {},
                "strategy": "group",
                "symmetric": True,
                "type": "int",
            },
        }
    },
    "format": "pack-quantized",
    "ignore": [
        "re:.*self_attn.*",
        "re:.*shared_experts.*",
        "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
        "re:.*lm_head.*",
        "re:vision_tower.*",
        "re:mm_projector.*",
    ],
    "kv_cache_scheme": None,
    "quant_method": "compressed-tensors",
    "quantization_status": "compressed",
}

GROUP_SIZE = 32
NUM_BITS = 4
PACK = 32 // NUM_BITS  # values per int32 word
PARAMS = ("weight_packed", "weight_scale", "weight_shape")
#: ``...mlp.experts.E.{gate,up,down}_proj`` (any prefix): the modules K2.5 quantizes.
EXPERT_MODULE = re.compile(r"^(?P<prefix>.*\.mlp\.experts\.(?P<expert>\d+)\.(?P<proj>gate|up|down)_proj)$")


def quantization_block() -> dict[str, Any]:
    """A fresh copy of :data:`K25_QUANTIZATION_CONFIG` (to put into a ``text_config``)."""
    return copy.deepcopy(K25_QUANTIZATION_CONFIG)


def quantization_config_of(config: Mapping[str, Any], text: Mapping[str, Any]) -> dict | None:
    """The checkpoint's quantization block: ``text_config.quantization_config`` (K2.5) or the top level's
    (K2-Thinking style), else ``None``."""
    block = text.get("quantization_config") or config.get("quantization_config")
    return dict(block) if block else None


def check_block(block: Mapping[str, Any], *, source: str = "config.json") -> None:
    """Refuse any quantization but K2.5's own (one line naming the field), then let compressed-tensors
    validate the block with its own schema."""

    def bad(what: str) -> KimiInputError:
        return KimiInputError(
            f"{source}: quantization_config {what}; specforge-kimi reads only K2.5's "
            f"compressed-tensors pack-quantized int4 symmetric group-{GROUP_SIZE} routed experts"
        )

    if block.get("quant_method") != "compressed-tensors":
        raise bad(f"quant_method is {block.get('quant_method')!r}, not 'compressed-tensors'")
    if block.get("format") != "pack-quantized":
        raise bad(f"format is {block.get('format')!r}, not 'pack-quantized'")
    groups = block.get("config_groups") or {}
    if len(groups) != 1:
        raise bad(f"has {len(groups)} config groups, not one")
    (group,) = groups.values()
    w = group.get("weights") or {}
    want = {
        "num_bits": NUM_BITS,
        "type": "int",
        "symmetric": True,
        "strategy": "group",
        "group_size": GROUP_SIZE,
        "dynamic": False,
    }
    for key, value in want.items():
        if w.get(key) != value:
            raise bad(f"weights.{key} is {w.get(key)!r}, not {value!r}")
    if group.get("input_activations") or group.get("output_activations"):
        raise bad("quantizes activations")
    if group.get("targets") != ["Linear"]:
        raise bad(f"targets are {group.get('targets')!r}, not ['Linear']")
    from compressed_tensors.quantization import QuantizationConfig
    from pydantic import ValidationError

    try:
        QuantizationConfig.model_validate(dict(block))
    except ValidationError as exc:
        raise bad(f"is not valid for compressed-tensors ({exc.errors()[0]['msg']})") from None


def scheme():
    """compressed-tensors' ``QuantizationScheme`` of K2.5's experts."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    w = K25_QUANTIZATION_CONFIG["config_groups"]["group_0"]["weights"]
    args = QuantizationArgs(
        **{k: w[k] for k in ("num_bits", "type", "symmetric", "strategy", "group_size", "dynamic", "observer")}
    )
    return QuantizationScheme(targets=["Linear"], weights=args, format="pack-quantized")


def is_ignored(module: str, block: Mapping[str, Any] = K25_QUANTIZATION_CONFIG) -> bool:
    """Whether the block's ``ignore`` list keeps ``module`` unquantized (compressed-tensors' own matching:
    ``re:`` entries anchored regexes, the rest exact names)."""
    from compressed_tensors.utils.match import match_name

    return any(match_name(module, target) for target in block.get("ignore") or [])


def packed_shapes(out_features: int, in_features: int) -> dict[str, tuple[int, ...]]:
    """On-disk shapes of one quantized projection ``[out, in]``."""
    if in_features % GROUP_SIZE:
        raise KimiInputError(f"an INT4 projection's input width {in_features} is not a multiple of {GROUP_SIZE}")
    return {
        "weight_packed": (out_features, in_features // PACK),
        "weight_scale": (out_features, in_features // GROUP_SIZE),
        "weight_shape": (2,),
    }


def quantize(weight) -> dict[str, Any]:
    """``{weight_packed, weight_scale, weight_shape}`` of a bf16 ``[out, in]`` weight, by compressed-tensors
    (min/max per group of 32, symmetric scale, packed by ``PackedQuantizationCompressor``). Runs on the
    weight's device; the scale is bf16 as K2.5 ships it."""
    import torch
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from compressed_tensors.quantization.utils import calculate_qparams

    if weight.dim() != 2:
        raise KimiInputError(f"INT4 quantization takes 2-D weights, not {list(weight.shape)}")
    out_f, in_f = weight.shape
    packed_shapes(out_f, in_f)  # the input width check
    s = scheme()
    groups = weight.float().view(out_f, in_f // GROUP_SIZE, GROUP_SIZE)
    scale, zero_point = calculate_qparams(groups.amin(-1), groups.amax(-1), s.weights)
    comp = PackedQuantizationCompressor.compress(
        {
            "weight": weight.to(torch.bfloat16),
            "weight_scale": scale.to(torch.bfloat16),
            "weight_zero_point": zero_point.to(torch.int8),
        },
        s,
    )
    if set(comp) != set(PARAMS):
        raise RuntimeError(f"compressed-tensors wrote {sorted(comp)}, expected {list(PARAMS)}")
    return {k: comp[k].contiguous() for k in PARAMS}


def check_packed(module: str, tensors: Mapping[str, Any], expected: tuple[int, int] | None = None) -> tuple[int, int]:
    """One quantized projection's tensors are complete and agree with each other (and with ``expected``
    ``[out, in]`` from the config): returns ``[out, in]``. Shapes are read, no data is needed."""
    missing = [p for p in PARAMS if p not in tensors]
    if missing:
        raise KimiInputError(f"{module}: INT4 projection without {', '.join(missing)}")
    packed, scale, shape = (tensors[p] for p in PARAMS)
    ws = [int(x) for x in (shape.tolist() if hasattr(shape, "tolist") else shape)]
    if len(ws) != 2:
        raise KimiInputError(f"{module}.weight_shape is {ws}, not [out, in]")
    want = packed_shapes(*ws)
    for name, t in (("weight_packed", packed), ("weight_scale", scale)):
        got = tuple(int(x) for x in (t.shape if hasattr(t, "shape") else t))
        if got != want[name]:
            raise KimiInputError(
                f"{module}.{name} has shape {list(got)}, weight_shape {ws} implies "
                f"{list(want[name])} (int4, group {GROUP_SIZE})"
            )
    if expected is not None and tuple(ws) != tuple(expected):
        raise KimiInputError(f"{module}.weight_shape is {ws}, the config implies {list(expected)}")
    return ws[0], ws[1]


def dequantize(module: str, tensors: Mapping[str, Any], expected: tuple[int, int] | None = None):
    """The bf16 ``[out, in]`` weight of one quantized projection, by compressed-tensors'
    ``PackedQuantizationCompressor.decompress`` (after :func:`check_packed`)."""
    import torch
    from compressed_tensors.compressors import PackedQuantizationCompressor

    check_packed(module, tensors, expected)
    if tensors["weight_packed"].dtype != torch.int32:
        raise KimiInputError(f"{module}.weight_packed is {tensors['weight_packed'].dtype}, not int32")
    return PackedQuantizationCompressor.decompress({p: tensors[p] for p in PARAMS}, scheme())["weight"]


def expert_shape(text: Mapping[str, Any], proj: str) -> tuple[int, int]:
    """``[out, in]`` of a routed expert's ``gate`` / ``up`` / ``down`` projection from the text config."""
    h, inter = text["hidden_size"], text["moe_intermediate_size"]
    return (h, inter) if proj == "down" else (inter, h)


def check_names(names, *, source: str) -> int:
    """The quantized tensors of a checkpoint (its tensor names) are K2.5's: only routed experts, each with
    all of :data:`PARAMS`, none also stored as a bf16 ``.weight``. Returns how many projections are
    quantized (0 = none)."""
    names = set(names)
    modules: dict[str, set[str]] = {}
    for n in names:
        module, _, param = n.rpartition(".")
        if param in PARAMS:
            modules.setdefault(module, set()).add(param)
    for module, params in sorted(modules.items()):
        if not EXPERT_MODULE.match(module.removeprefix("language_model.")):
            raise KimiInputError(f"{source}: {module} is quantized, but K2.5 quantizes only routed experts")
        if params != set(PARAMS):
            raise KimiInputError(f"{source}: {module} is INT4 without {', '.join(sorted(set(PARAMS) - params))}")
        if f"{module}.weight" in names:
            raise KimiInputError(f"{source}: {module} has both a bf16 weight and INT4 tensors")
    unquantized = sorted(n for n in names if n.endswith(".weight") and EXPERT_MODULE.match(n[: -len(".weight")]))
    if modules and unquantized:
        raise KimiInputError(
            f"{source}: the config quantizes routed experts but {unquantized[0]} is bf16 ({len(unquantized)} such)"
        )
    return len(modules)


__all__ = [
    "expert_shape",
    "check_names",
    "K25_QUANTIZATION_CONFIG",
    "GROUP_SIZE",
    "NUM_BITS",
    "PARAMS",
    "EXPERT_MODULE",
    "quantization_block",
    "quantization_config_of",
    "check_block",
    "scheme",
    "is_ignored",
    "packed_shapes",
    "quantize",
    "check_packed",
    "dequantize",
]
