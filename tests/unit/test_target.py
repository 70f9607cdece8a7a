"""Target adapter: kimi_k25 config resolution, sizes from text_config, weight keys, bad input."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from specforge_kimi.errors import KimiInputError
from specforge_kimi.targets.checkpoint import inspect_target, register_config, resolve_weight_key


def test_autoconfig_resolves_kimi_k25_without_remote_code(tiny_dir):
    from transformers import AutoConfig

    register_config()
    register_config()  # idempotent
    cfg = AutoConfig.from_pretrained(str(tiny_dir))
    assert cfg.model_type == "kimi_k25"
    assert cfg.text_config.model_type == "deepseek_v3"
    # top-level reads (SpecForge's TargetHead) see the text model's sizes
    assert (cfg.hidden_size, cfg.vocab_size, cfg.num_hidden_layers) == (64, 163840, 6)


def test_specforge_target_head_reads_text_config_and_k25_key(tiny_dir):
    from specforge.modeling.target.target_head import TargetHead

    from specforge_kimi.registration import _install_weight_key_resolution

    register_config()
    _install_weight_key_resolution()
    _install_weight_key_resolution()  # idempotent: no double wrapping
    head = TargetHead(str(tiny_dir))
    assert tuple(head.fc.weight.shape) == (163840, 64)
    head.load_weights(model_path=str(tiny_dir), lm_head_key="lm_head.weight")  # SpecForge's default key
    ref = load_file(str(next(tiny_dir.glob("*.safetensors"))))["language_model.lm_head.weight"]
    assert torch.equal(head.fc.weight.data.to(ref.dtype), ref)


def test_specforge_embedding_loader_resolves_k25_key(tiny_dir):
    from specforge.modeling.target.target_utils import TargetEmbeddingsAndHead

    from specforge_kimi.registration import _install_weight_key_resolution

    register_config()
    _install_weight_key_resolution()
    parts = TargetEmbeddingsAndHead.from_pretrained(str(tiny_dir), device="cpu", dtype=torch.float32)
    ref = load_file(str(next(tiny_dir.glob("*.safetensors"))))["language_model.model.embed_tokens.weight"]
    assert torch.equal(parts.embed_tokens.weight.data.to(ref.dtype), ref)


def test_inspect_and_keys(tiny_dir):
    info = inspect_target(tiny_dir)
    assert info.wrapper and info.layout == "kimi_k25"
    assert (info.hidden_size, info.vocab_size, info.num_layers) == (64, 163840, 6)
    assert info.embedding_key == "language_model.model.embed_tokens.weight"
    assert info.lm_head_key == "language_model.lm_head.weight"
    assert resolve_weight_key(tiny_dir, "model.embed_tokens.weight", "embedding") == info.embedding_key


def _copy(tiny_dir, tmp_path, rename=None, config_edit=None, drop=None, reshape=None):
    out = tmp_path / "ckpt"
    out.mkdir()
    index = json.loads((tiny_dir / "model.safetensors.index.json").read_text())
    tensors = {}
    for f in sorted(set(index["weight_map"].values())):
        tensors.update(load_file(str(tiny_dir / f)))
    if rename:
        tensors = {rename(k): v for k, v in tensors.items()}
    if drop:
        tensors = {k: v for k, v in tensors.items() if k not in drop}
    if reshape:
        for k, shape in reshape.items():
            tensors[k] = torch.zeros(shape, dtype=torch.bfloat16)
    save_file(tensors, str(out / "model.safetensors"))
    cfg = json.loads((tiny_dir / "config.json").read_text())
    if config_edit:
        config_edit(cfg)
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def test_nvfp4_naming(tiny_dir, tmp_path):
    out = _copy(
        tiny_dir, tmp_path, rename=lambda k: k.replace("language_model.model.layers.", "language_model.layers.")
    )
    info = inspect_target(out)
    assert info.layout == "kimi_k25_nvfp4" and info.layers_prefix == "language_model.layers."
    assert resolve_weight_key(out, "lm_head.weight", "lm_head") == "language_model.lm_head.weight"


@pytest.mark.parametrize(
    "case,msg",
    [
        ("llama", "not a Kimi-K2.5 / DeepSeek-V3 target"),
        ("no_text_config", "must carry a text_config"),
        ("no_safetensors", "no \\*.safetensors"),
        ("bad_shape", "has shape \\[163840, 32\\], but the config says"),
        ("layers", "num_hidden_layers=7"),
        ("no_config", "config.json not found"),
        ("bad_json", "not valid JSON"),
    ],
)
def test_bad_checkpoints(tiny_dir, tmp_path, case, msg):
    if case == "llama":
        out = _copy(
            tiny_dir,
            tmp_path,
            config_edit=lambda c: (
                c.update(model_type="llama", architectures=["LlamaForCausalLM"])
                or c.update(text_config=None)
                or c.update(hidden_size=64, vocab_size=163840, num_hidden_layers=6)
            ),
        )
    elif case == "no_text_config":
        out = _copy(tiny_dir, tmp_path, config_edit=lambda c: c.pop("text_config"))
    elif case == "no_safetensors":
        out = tmp_path / "empty"
        out.mkdir()
        shutil.copy(tiny_dir / "config.json", out / "config.json")
    elif case == "bad_shape":
        out = _copy(tiny_dir, tmp_path, reshape={"language_model.lm_head.weight": (163840, 32)})
    elif case == "layers":
        out = _copy(tiny_dir, tmp_path, config_edit=lambda c: c["text_config"].update(num_hidden_layers=7))
    elif case == "no_config":
        out = tmp_path / "noconf"
        out.mkdir()
    else:
        out = tmp_path / "badjson"
        out.mkdir()
        (out / "config.json").write_text("{not json")
    with pytest.raises(KimiInputError, match=msg):
        inspect_target(out)
