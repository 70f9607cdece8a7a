"""The Kimi-K2.5 target: config nesting, weight names, checkpoint checks, torch text model.

Scope: K2.5-style checkpoints (``model_type: kimi_k25`` wrapping a DeepSeek-V3 ``text_config``,
weights under ``language_model.``) and plain DeepSeek-V3 checkpoints, read from a local
directory. Nothing here talks to a hub. Reading a checkpoint's layout uses safetensors headers
only; :func:`load_text_model` is the one function that materializes weights (for the reference
capture and the CPU demo, i.e. tiny targets).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specforge_kimi.errors import KimiInputError

WRAPPER_MODEL_TYPE = "kimi_k25"
WRAPPER_ARCH = "KimiK25ForConditionalGeneration"
TEXT_MODEL_TYPES = ("deepseek_v3", "kimi_k2")

#: Weight-name prefixes of the text decoder, as shipped (K2.5) and as NVIDIA's NVFP4 export names them.
LAYOUTS = {
    "kimi_k25": {
        "embedding": "language_model.model.embed_tokens.weight",
        "lm_head": "language_model.lm_head.weight",
        "norm": "language_model.model.norm.weight",
        "layers": "language_model.model.layers.",
    },
    "kimi_k25_nvfp4": {
        "embedding": "language_model.model.embed_tokens.weight",
        "lm_head": "language_model.lm_head.weight",
        "norm": "language_model.model.norm.weight",
        "layers": "language_model.layers.",
    },
    "deepseek_v3": {
        "embedding": "model.embed_tokens.weight",
        "lm_head": "lm_head.weight",
        "norm": "model.norm.weight",
        "layers": "model.layers.",
    },
}


# --------------------------------------------------------------------------------------------
# transformers config class (registered by specforge_kimi.register())
# --------------------------------------------------------------------------------------------
def _config_class():
    from transformers import DeepseekV3Config, PretrainedConfig

    class KimiK25Config(PretrainedConfig):
        """``kimi_k25`` without remote code: ``text_config`` (DeepSeek-V3) + ``vision_config`` dict.

        ``hidden_size``, ``vocab_size`` and ``num_hidden_layers`` read through to ``text_config``
        so that code reading them at top level (SpecForge's TargetHead, draft-config derivation)
        sees the text model's sizes instead of failing or reading defaults.
        """

        model_type = WRAPPER_MODEL_TYPE
        sub_configs = {"text_config": DeepseekV3Config}

        def __init__(
            self, text_config: Any = None, vision_config: Any = None, media_placeholder_token_id: int = 163605, **kwargs
        ):
            if text_config is None:
                text_config = DeepseekV3Config()
            elif isinstance(text_config, dict):
                text_config = DeepseekV3Config(**text_config)
            self.text_config = text_config
            self.vision_config = dict(vision_config or {})
            self.media_placeholder_token_id = media_placeholder_token_id
            for name in ("hidden_size", "vocab_size", "num_hidden_layers"):
                kwargs.pop(name, None)
            super().__init__(**kwargs)

        @property
        def hidden_size(self) -> int:
            return self.text_config.hidden_size

        @property
        def vocab_size(self) -> int:
            return self.text_config.vocab_size

        @property
        def num_hidden_layers(self) -> int:
            return self.text_config.num_hidden_layers

    return KimiK25Config


_CONFIG_CLASS = None


def kimi_k25_config_class():
    """The (cached) ``KimiK25Config`` class; importing transformers happens here, not at import."""
    global _CONFIG_CLASS
    if _CONFIG_CLASS is None:
        _CONFIG_CLASS = _config_class()
    return _CONFIG_CLASS


def register_config() -> None:
    """Make ``AutoConfig.from_pretrained(dir)`` resolve ``kimi_k25`` without remote code."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cls = kimi_k25_config_class()
    if CONFIG_MAPPING._extra_content.get(WRAPPER_MODEL_TYPE) is cls:
        return
    AutoConfig.register(WRAPPER_MODEL_TYPE, cls, exist_ok=True)


# --------------------------------------------------------------------------------------------
# config.json reading (plain JSON: works without transformers)
# --------------------------------------------------------------------------------------------
def read_config(model_dir: str | os.PathLike) -> dict:
    """``config.json`` of a local checkpoint directory, with a clear error when absent or bad."""
    path = Path(model_dir) / "config.json"
    if not Path(model_dir).is_dir():
        raise KimiInputError(f"target checkpoint {model_dir} is not a directory")
    if not path.is_file():
        raise KimiInputError(f"{path} not found: not a Hugging Face checkpoint directory")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise KimiInputError(f"{path} is not valid JSON: {exc}") from None


def text_config_dict(config: dict, *, source: str = "config.json") -> dict:
    """The DeepSeek-V3 text config of a K2.5 wrapper or plain DeepSeek-V3 config (as a dict)."""
    model_type = config.get("model_type")
    if model_type == WRAPPER_MODEL_TYPE or WRAPPER_ARCH in (config.get("architectures") or []):
        text = config.get("text_config")
        if not isinstance(text, dict):
            raise KimiInputError(
                f"{source}: a {WRAPPER_MODEL_TYPE} wrapper config must carry a text_config (the DeepSeek-V3 "
                "language model); this one has none"
            )
    else:
        text = config
    if text.get("model_type") not in TEXT_MODEL_TYPES:
        raise KimiInputError(
            f"{source}: model_type {text.get('model_type')!r} is not a Kimi-K2.5 / DeepSeek-V3 target "
            f"(expected {WRAPPER_MODEL_TYPE} wrapping one of {TEXT_MODEL_TYPES})"
        )
    for key in ("hidden_size", "vocab_size", "num_hidden_layers"):
        if not isinstance(text.get(key), int) or text[key] <= 0:
            raise KimiInputError(f"{source}: text config has no valid {key} (got {text.get(key)!r})")
    return text


# --------------------------------------------------------------------------------------------
# checkpoint layout
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TargetInfo:
    """What SpecForge and our tools need to know about a target checkpoint."""

    path: str
    wrapper: bool
    layout: str
    hidden_size: int
    vocab_size: int
    num_layers: int
    embedding_key: str
    lm_head_key: str
    layers_prefix: str
    text: dict
    #: ``None`` (bf16 experts) or the routed experts' format, e.g. ``int4 pack-quantized group 32 (N projections)``
    quantization: str | None = None


def weight_index(model_dir: str | os.PathLike) -> dict[str, str]:
    """Map tensor name -> shard file, from ``*.index.json`` or from the safetensors headers."""
    d = Path(model_dir)
    indexes = sorted(d.glob("*.safetensors.index.json"))
    if len(indexes) > 1:
        raise KimiInputError(f"{d} has several safetensors index files: {[p.name for p in indexes]}")
    if indexes:
        try:
            weight_map = json.loads(indexes[0].read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise KimiInputError(f"{indexes[0]} is not a safetensors index ({exc})") from None
        missing = sorted({f for f in weight_map.values() if not (d / f).is_file()})
        if missing:
            raise KimiInputError(f"{indexes[0].name} names shard files that are missing: {missing[:5]}")
        return dict(weight_map)
    shards = sorted(d.glob("*.safetensors"))
    if not shards:
        raise KimiInputError(f"{d} has no *.safetensors files: not a usable checkpoint directory")
    from safetensors import safe_open

    out: dict[str, str] = {}
    for shard in shards:
        with safe_open(str(shard), framework="pt") as f:
            for k in f.keys():
                out[k] = shard.name
    return out


def tensor_shapes(model_dir: str | os.PathLike, names: Iterable[str]) -> dict[str, tuple[int, ...]]:
    """Shapes of ``names`` read from safetensors headers (no tensor data is loaded)."""
    from safetensors import safe_open

    index = weight_index(model_dir)
    by_file: dict[str, list[str]] = {}
    for n in names:
        if n not in index:
            raise KimiInputError(f"{model_dir}: tensor {n} is not in the checkpoint")
        by_file.setdefault(index[n], []).append(n)
    shapes: dict[str, tuple[int, ...]] = {}
    for fname, keys in by_file.items():
        with safe_open(str(Path(model_dir) / fname), framework="pt") as f:
            for k in keys:
                shapes[k] = tuple(f.get_slice(k).get_shape())
    return shapes


def detect_layout(names: Iterable[str]) -> str:
    """Which naming a checkpoint uses: ``kimi_k25``, ``kimi_k25_nvfp4`` or ``deepseek_v3``."""
    names = set(names)
    if any(n.startswith(LAYOUTS["kimi_k25"]["layers"]) for n in names):
        return "kimi_k25"
    if any(n.startswith(LAYOUTS["kimi_k25_nvfp4"]["layers"]) for n in names):
        return "kimi_k25_nvfp4"
    if any(n.startswith(LAYOUTS["deepseek_v3"]["layers"]) for n in names):
        return "deepseek_v3"
    raise KimiInputError(
        "checkpoint has no decoder layers under language_model.model.layers., language_model.layers. "
        "or model.layers.: not a Kimi-K2.5 / DeepSeek-V3 checkpoint"
    )


def inspect_target(model_dir: str | os.PathLike) -> TargetInfo:
    """Read and check a target checkpoint: config nesting, weight keys, embedding/head shapes."""
    config = read_config(model_dir)
    text = text_config_dict(config, source=f"{model_dir}/config.json")
    wrapper = text is not config
    index = weight_index(model_dir)
    layout = detect_layout(index)
    if wrapper != layout.startswith("kimi_k25"):
        raise KimiInputError(
            f"{model_dir}: config says {'a kimi_k25 wrapper' if wrapper else 'a plain model'} but the "
            f"weights use the {layout} naming"
        )
    keys = LAYOUTS[layout]
    missing = [keys[k] for k in ("embedding", "lm_head") if keys[k] not in index]
    if missing:
        raise KimiInputError(f"{model_dir}: missing tensors {missing} for the {layout} layout")
    hidden, vocab, layers = text["hidden_size"], text["vocab_size"], text["num_hidden_layers"]
    shapes = tensor_shapes(model_dir, [keys["embedding"], keys["lm_head"]])
    for k, shape in shapes.items():
        if shape != (vocab, hidden):
            raise KimiInputError(
                f"{model_dir}: {k} has shape {list(shape)}, but the config says vocab_size={vocab}, "
                f"hidden_size={hidden}"
            )
    present = {int(n[len(keys["layers"]) :].split(".", 1)[0]) for n in index if n.startswith(keys["layers"])}
    if present != set(range(layers)):
        raise KimiInputError(
            f"{model_dir}: config says num_hidden_layers={layers}, checkpoint has layers "
            f"{sorted(present)[:3]}..{sorted(present)[-3:]} ({len(present)} layers)"
        )
    return TargetInfo(
        str(model_dir),
        wrapper,
        layout,
        hidden,
        vocab,
        layers,
        keys["embedding"],
        keys["lm_head"],
        keys["layers"],
        text,
        _quantization(model_dir, config, text, index),
    )


def _quantization(model_dir, config: dict, text: dict, index: dict) -> str | None:
    """K2.5's INT4 routed experts checked by name (config block, complete triplets); shapes: ``doctor``."""
    from specforge_kimi.targets import int4

    block = int4.quantization_config_of(config, text)
    source = f"{model_dir}/config.json"
    if block is None:
        if any(n.endswith(".weight_packed") for n in index):
            raise KimiInputError(f"{model_dir}: tensors are INT4-packed but config.json has no quantization_config")
        return None
    int4.check_block(block, source=source)
    n = int4.check_names(index, source=str(model_dir))
    if n == 0:
        raise KimiInputError(f"{source}: quantization_config says INT4 routed experts, no tensor is packed")
    return f"int4 pack-quantized symmetric group {int4.GROUP_SIZE}, {n} routed-expert projections"


def check_int4_shapes(model_dir: str | os.PathLike, info: TargetInfo) -> int:
    """Every INT4 projection's ``weight_packed`` / ``weight_scale`` shapes and ``weight_shape`` values
    against the config (safetensors headers and the int [2] tensors only). Returns the count checked."""
    from safetensors import safe_open

    from specforge_kimi.targets import int4

    index = weight_index(model_dir)
    by_file: dict[str, list[str]] = {}
    for n in index:
        if n.endswith(".weight_packed"):
            by_file.setdefault(index[n], []).append(n[: -len(".weight_packed")])
    count = 0
    for module_file in sorted(by_file):
        for module in by_file[module_file]:
            m = int4.EXPERT_MODULE.match(module.removeprefix("language_model."))
            parts = {}
            for p in int4.PARAMS:
                with safe_open(str(Path(model_dir) / index[f"{module}.{p}"]), framework="pt") as f:
                    parts[p] = (
                        f.get_tensor(f"{module}.{p}")
                        if p == "weight_shape"
                        else f.get_slice(f"{module}.{p}").get_shape()
                    )
            int4.check_packed(module, parts, int4.expert_shape(info.text, m.group("proj")))
            count += 1
    return count


def resolve_weight_key(model_dir: str | os.PathLike, key: str, role: str) -> str:
    """Map a requested embedding/head key to the one this checkpoint really has.

    ``role`` is ``"embedding"`` or ``"lm_head"``. A key present in the checkpoint is returned as
    is; a default DeepSeek/Llama key on a K2.5 checkpoint is mapped to the K2.5 name.
    """
    index = weight_index(model_dir)
    if key in index:
        return key
    layout = detect_layout(index)
    resolved = LAYOUTS[layout][role]
    if resolved not in index:
        raise KimiInputError(f"{model_dir}: neither {key} nor {resolved} is in the checkpoint")
    return resolved


# --------------------------------------------------------------------------------------------
# torch text model (tiny targets: reference capture, CPU demo)
# --------------------------------------------------------------------------------------------
def hf_text_config(text: dict):
    """A transformers ``DeepseekV3Config`` from a text-config dict."""
    from transformers import DeepseekV3Config

    return DeepseekV3Config(**{k: v for k, v in text.items() if k not in ("architectures", "auto_map")})


def load_text_model(model_dir: str | os.PathLike, dtype=None):
    """transformers ``DeepseekV3ForCausalLM`` holding the checkpoint's text weights.

    Per-expert tensors (``mlp.experts.E.{gate,up,down}_proj.weight``, K2.5's on-disk names) are
    fused into transformers 5's ``experts.gate_up_proj`` [E, 2I, H] (gate rows first, as its
    forward splits them) and ``experts.down_proj`` [E, H, I]. K2.5's INT4 experts
    (:mod:`specforge_kimi.targets.int4`) are dequantized by compressed-tensors first, each checked against
    its ``weight_shape`` and the config: the model computes with exactly the weights SGLang dequantizes.
    """
    import torch
    from safetensors import safe_open
    from transformers import DeepseekV3ForCausalLM

    from specforge_kimi.targets import int4

    info = inspect_target(model_dir)
    dtype = dtype or torch.float32
    cfg = hf_text_config(info.text)
    model = DeepseekV3ForCausalLM(cfg).to(dtype)
    state: dict[str, torch.Tensor] = {}
    prefix = {"kimi_k25": "language_model.", "kimi_k25_nvfp4": "language_model.", "deepseek_v3": ""}[info.layout]
    index = weight_index(model_dir)
    files: dict[str, list[str]] = {}
    for name, fname in index.items():
        if name.startswith(prefix) and not name.startswith(("vision_tower.", "mm_projector.")):
            files.setdefault(fname, []).append(name)
    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    packed: dict[str, dict[str, torch.Tensor]] = {}
    for fname, names in files.items():
        with safe_open(str(Path(model_dir) / fname), framework="pt") as f:
            for name in names:
                hf = name[len(prefix) :]
                if info.layout == "kimi_k25_nvfp4" and hf.startswith("layers."):
                    hf = "model." + hf
                parts = hf.split(".")
                if len(parts) == 8 and parts[3] == "mlp" and parts[4] == "experts" and parts[5].isdigit():
                    if parts[7] in int4.PARAMS:
                        packed.setdefault(name[: -len(parts[7]) - 1], {})[parts[7]] = f.get_tensor(name)
                        continue
                    experts.setdefault((int(parts[2]), parts[6]), {})[int(parts[5])] = f.get_tensor(name).to(dtype)
                else:
                    state[hf] = f.get_tensor(name).to(dtype)
    for module, tensors in packed.items():  # INT4 routed experts -> bf16 by compressed-tensors, then dtype
        parts = module[len(prefix) :].split(".")
        w = int4.dequantize(module, tensors, int4.expert_shape(info.text, parts[6].removesuffix("_proj")))
        experts.setdefault((int(parts[2]), parts[6]), {})[int(parts[5])] = w.to(dtype)
    n_exp = info.text.get("n_routed_experts") or 0
    for (layer, proj), by_e in list(experts.items()):
        if len(by_e) != n_exp:
            raise KimiInputError(f"{model_dir}: layer {layer} {proj} has {len(by_e)} experts, config says {n_exp}")
    for layer in sorted({layer for layer, _ in experts}):
        g, u, d = (experts[(layer, p)] for p in ("gate_proj", "up_proj", "down_proj"))
        state[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([g[e], u[e]], dim=0) for e in range(n_exp)]
        )
        state[f"model.layers.{layer}.mlp.experts.down_proj"] = torch.stack([d[e] for e in range(n_exp)])
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    if missing:
        raise KimiInputError(f"{model_dir}: text weights missing: {missing[:5]}")
    for k, v in expected.items():
        if tuple(state[k].shape) != tuple(v.shape):
            raise KimiInputError(f"{model_dir}: {k} has shape {list(state[k].shape)}, config implies {list(v.shape)}")
    model.load_state_dict({k: state[k] for k in expected}, strict=True)
    return model.eval()


def resolve_device(device: str) -> str:
    """``auto`` -> ``cuda`` when CUDA is available, else ``cpu``; a ``cuda`` device without CUDA is an
    input error (the ``--device`` of ``tiny --pretrain`` and ``target-text``)."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise KimiInputError(f"--device {device}: CUDA is not available here; use --device cpu")
    return device


def is_kimi_k25_checkpoint(model_path: str | os.PathLike | None) -> bool:
    """True for a local checkpoint directory whose ``config.json`` is K2.5's wrapper."""
    if not model_path or not Path(model_path).is_dir() or not (Path(model_path) / "config.json").is_file():
        return False
    cfg = read_config(model_path)
    return cfg.get("model_type") == WRAPPER_MODEL_TYPE or WRAPPER_ARCH in (cfg.get("architectures") or [])
