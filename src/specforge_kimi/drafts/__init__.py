"""EAGLE-3 draft architectures and their per-engine exports.

- :mod:`.mla_eagle3`: a trainable EAGLE-3 draft with DeepSeek MLA attention that computes what
  SGLang 0.5.14's ``Eagle3DeepseekV2ForCausalLM`` (``sglang/srt/models/kimi_k25_eagle3.py``)
  serves, its config (K2.5 default, tiny variant) and its explicit SpecForge registration.
- :mod:`.export_engines`: SGLang and vLLM export of that draft and of SpecForge's Llama-style
  draft, with aux layer ids converted per engine (:mod:`specforge_kimi.targets.layer_ids`) and
  provenance.

Nothing heavy is imported here; the submodules import torch/transformers/specforge.
"""
