"""Exported drafts loaded by SGLang 0.5.14 give the training-side forward's logits (MLA + Llama).

What runs, per draft (``Eagle3DeepseekV2ForCausalLM`` = our MLA draft, ``LlamaForCausalLMEagle3``
= SpecForge's Llama-style draft): random weights are written as a SpecForge-shaped eagle3
checkpoint, exported with :func:`specforge_kimi.drafts.export_engines.export_draft` for SGLang,
and loaded by SGLang's own model loader through a ``ModelRunner`` (one GPU, no server, no
target: the same construction ``sglang.bench_one_batch`` uses). One extend batch (positions
0..T-1, several sequences) is run with ``forward_batch.spec_info.hidden_states`` = the aux
states, exactly what the EAGLE worker hands the draft; the embedding is shared in with the
model's ``set_embed`` as the EAGLE worker does with the target's. We read the draft model's
``(hidden_to_logits, [aux])`` and project with its ``lm_head`` weight (the logits processor is a
plain matmul for these configs). Each SGLang forward runs in a fresh subprocess (SGLang's
distributed state is per process).

Reference: the training-side module rebuilt from the export (:func:`load_exported_draft`), fp32
on the GPU, same inputs. Tolerances, stated:
- per-token cosine(SGLang logits, reference logits) >= 0.995 and relative Frobenius error per
  sequence <= 0.03 (bf16 serving vs fp32 reference, random weights);
- rope/scale identity, strict: SGLang must be >= 5x closer (relative error) to the reference
  than to references with one thing changed -- MLA: softmax scale without YaRN's mscale**2,
  NeoX instead of interleaved rope pairs; Llama: rope theta / 8, theta 1e30 (all but the first
  pair nearly unrotated). CPU proxy with these weights (training-side module in bf16 vs fp32,
  T = 17 / 128): 0.5-0.7% relative error, mutants 7.6-31%; passing proves rope parity.

Writes ``draft_logits_parity.json`` into ``$SPECFORGE_KIMI_GPU_OUT`` (default: a temporary
directory), including any SGLang traceback. Run: ``pytest tests/gpu/test_draft_logits_parity.py
--run-gpu -x -q``. ``SPECFORGE_KIMI_DRAFT_ATTN_BACKEND`` picks SGLang's attention backend
(default ``triton``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

#: the results folder, made at the first record (not at collection, where a skipped run would leave it behind)
_OUT: list[Path] = []
BACKEND = os.environ.get("SPECFORGE_KIMI_DRAFT_ATTN_BACKEND", "triton")
LENGTHS = (17, 128, 768)
VOCAB, DRAFT_VOCAB, HIDDEN, NUM_LAYERS = 32000, 4096, 1024, 61
COS_MIN, REL_MAX, MARGIN_MIN = 0.995, 0.03, 5.0


# ---- the SGLang side (runs in a subprocess) ---------------------------------------------------
def sglang_forward(export_dir: str, inputs_path: str, out_path: str, backend: str) -> None:
    """Load ``export_dir`` with SGLang's loader and run one extend batch with aux states."""
    from array import array
    from types import SimpleNamespace

    import torch
    from sglang.bench_one_batch import TreeCacheNamespace
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.entrypoints.engine import _set_envs_and_config
    from sglang.srt.layers.communicator import get_attn_tp_context
    from sglang.srt.layers.moe import initialize_moe_config
    from sglang.srt.layers.quantization.fp4_utils import initialize_fp4_gemm_config
    from sglang.srt.layers.quantization.fp8_utils import initialize_fp8_gemm_config
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.server_args import PortArgs, ServerArgs
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    server_args = ServerArgs(
        model_path=export_dir,
        skip_tokenizer_init=True,
        attention_backend=backend,
        disable_cuda_graph=True,
        disable_radix_cache=True,
        mem_fraction_static=0.3,
        dtype="bfloat16",
        tp_size=1,
    )
    _set_envs_and_config(server_args)
    port_args = PortArgs.init_new(server_args)
    initialize_moe_config(server_args)
    initialize_fp8_gemm_config(server_args)
    initialize_fp4_gemm_config(server_args)
    runner = ModelRunner(
        model_config=ModelConfig.from_server_args(server_args),
        mem_fraction_static=server_args.mem_fraction_static,
        gpu_id=0,
        tp_rank=0,
        tp_size=1,
        moe_ep_rank=0,
        moe_ep_size=1,
        pp_rank=0,
        pp_size=1,
        nccl_port=port_args.nccl_port,
        server_args=server_args,
    )
    runner.alloc_memory_pool()
    runner.init_attention_backends()
    inputs = torch.load(inputs_path)
    model = runner.model
    model.set_embed(inputs["embed"].to(device=runner.device, dtype=torch.bfloat16))

    reqs = []
    for i, ids in enumerate(inputs["input_ids"]):
        req = Req(
            rid=i,
            origin_input_text="",
            origin_input_ids=array("q", ids.tolist()),
            sampling_params=SamplingParams(temperature=0, max_new_tokens=1),
        )
        req.full_untruncated_fill_ids = req.origin_input_ids
        req.fill_len = len(req.full_untruncated_fill_ids)
        req.logprob_start_len = -1
        req.set_extend_input_len(req.fill_len - len(req.prefix_indices))
        reqs.append(req)
    tree_cache = TreeCacheNamespace(
        page_size=server_args.page_size,
        device=runner.device,
        token_to_kv_pool_allocator=runner.token_to_kv_pool_allocator,
    )
    batch = ScheduleBatch.init_new(
        reqs=reqs,
        req_to_token_pool=runner.req_to_token_pool,
        token_to_kv_pool_allocator=runner.token_to_kv_pool_allocator,
        tree_cache=tree_cache,
        model_config=runner.model_config,
        enable_overlap=False,
        spec_algorithm=SpeculativeAlgorithm.NONE,
    )
    batch.prepare_for_extend()
    if batch.input_ids is None and getattr(batch, "prefill_input_ids_cpu", None) is not None:
        batch.input_ids = batch.prefill_input_ids_cpu.to(batch.device, non_blocking=True)
        batch.prefill_input_ids_cpu = None
    forward_batch = ForwardBatch.init_new(batch, runner)
    aux = torch.cat(list(inputs["aux"]), 0).to(device=runner.device, dtype=torch.bfloat16)  # token-major
    forward_batch.spec_info = SimpleNamespace(hidden_states=aux)
    with torch.no_grad():
        runner.attn_backend.init_forward_metadata(forward_batch)
        # ModelRunner._forward_raw publishes this context around every forward; model code reads the
        # attention backend (and through it the KV pools) from it
        with (
            forward_context(ForwardContext(attn_backend=runner.attn_backend)),
            get_attn_tp_context().maybe_input_scattered(forward_batch),
        ):
            to_logits, aux_out = model.model(forward_batch.input_ids, forward_batch.positions, forward_batch)
        logits = to_logits.float() @ model.lm_head.weight.float().T
    torch.save(
        {
            "logits": logits.cpu(),
            "aux": aux_out[0].float().cpu(),
            "positions": forward_batch.positions.cpu(),
            "input_ids": forward_batch.input_ids.cpu(),
        },
        out_path,
    )


# ---- the training side and the comparison ---------------------------------------------------
def _draft_config(arch: str) -> dict:
    if arch == "Eagle3DeepseekV2ForCausalLM":
        from specforge_kimi.drafts.mla_eagle3 import _base_config, _k25_rope

        # K2.5's MLA head dims and rope (SGLang's MLA kernels are built for them), small width.
        return _base_config(
            hidden=HIDDEN,
            heads=16,
            intermediate=2048,
            q_lora_rank=1536,
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
            vocab_size=VOCAB,
            draft_vocab_size=DRAFT_VOCAB,
            aux_ids=[1, 29, 57],
            rope_scaling=_k25_rope(),
            rope_theta=50000.0,
            max_position_embeddings=262144,
            rms_norm_eps=1e-5,
            pad_token_id=0,
            fc_norm=True,
            norm_output=False,
        )
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "num_hidden_layers": 1,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "intermediate_size": 2048,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 4096,
        "rope_theta": 50000.0,
        "vocab_size": VOCAB,
        "draft_vocab_size": DRAFT_VOCAB,
        "pad_token_id": 0,
        "tie_word_embeddings": False,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 29, 57]},
    }


def _export(arch: str, work: Path) -> Path:
    """Random-weight SpecForge-shaped checkpoint -> export_draft(engine='sglang')."""
    import torch

    from specforge_kimi import register
    from specforge_kimi.drafts import mla_eagle3
    from specforge_kimi.drafts.export_engines import export_draft

    register()
    cfg = _draft_config(arch)
    (work / "draft.json").write_text(json.dumps(cfg))
    if arch == mla_eagle3.ARCH:
        model = mla_eagle3.Eagle3DeepseekV2ForCausalLM(mla_eagle3.KimiMLAEagle3Config.from_dict(cfg))
    else:
        from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
        from transformers import LlamaConfig

        model = LlamaForCausalLMEagle3(LlamaConfig.from_dict(cfg))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    used = torch.randperm(VOCAB, generator=g)[:DRAFT_VOCAB].sort().values
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[used] = True
    torch.save({"d2t": used - torch.arange(DRAFT_VOCAB), "t2d": t2d}, work / "vm.pt")
    model.load_vocab_mapping(str(work / "vm.pt"))
    step = work / "run" / "x-step1"
    step.mkdir(parents=True)
    torch.save(
        {"strategy": "eagle3", "draft_state_dict": {k: v for k, v in model.state_dict().items() if "embed" not in k}},
        step / "training_state.pt",
    )
    torch.save(model.embed_tokens.weight.detach().clone(), work / "embed.pt")
    out = work / "export"
    export_draft(
        step, work / "draft.json", out, engine="sglang", num_layers=NUM_LAYERS, vocab_mapping_path=str(work / "vm.pt")
    )
    return out


def _reference(model, arch: str, ids, aux, mutate=None):
    """Training-side logits for one sequence (fp32), optionally with one thing changed."""
    import torch

    model = _mutated(model, arch, mutate) if mutate else model
    pos = torch.arange(ids.shape[0], device=ids.device).unsqueeze(0)
    with torch.no_grad():
        hidden = model.project_hidden_states(aux[None])
        state = model.backbone(
            model.embed_input_ids(ids[None]), hidden, cache_hidden=None, attention_mask=None, position_ids=pos
        )
        return model.compute_logits(state)[0].float()


def _mutated(model, arch: str, what: str):
    import copy

    m = copy.deepcopy(model)
    attn = m.midlayer.self_attn
    if arch == "Eagle3DeepseekV2ForCausalLM":
        if what == "no_mscale_softmax":
            attn.scaling = attn.rope.qk_head_dim**-0.5
        elif what == "neox_rope":
            attn.rope = dataclasses.replace(attn.rope, interleaved=False)
    else:
        from specforge.modeling.draft.llama3_eagle import LlamaRotaryEmbedding

        if what == "theta_div8":
            theta = _draft_config(arch)["rope_theta"]
            attn.rotary_emb = LlamaRotaryEmbedding(attn.head_dim, max_position_embeddings=4096, base=theta / 8).to(
                next(m.parameters()).device
            )
        elif what == "theta_1e30":
            attn.rotary_emb = LlamaRotaryEmbedding(attn.head_dim, max_position_embeddings=4096, base=1e30).to(
                next(m.parameters()).device
            )
    return m


MUTANTS = {
    "Eagle3DeepseekV2ForCausalLM": ("no_mscale_softmax", "neox_rope"),
    "LlamaForCausalLMEagle3": ("theta_div8", "theta_1e30"),
}


def _summary_path() -> Path:
    if not _OUT:
        _OUT.append(Path(os.environ.get("SPECFORGE_KIMI_GPU_OUT") or tempfile.mkdtemp(prefix="draft-parity-")))
    _OUT[0].mkdir(parents=True, exist_ok=True)
    return _OUT[0] / "draft_logits_parity.json"


def _record(arch: str, result: dict) -> None:
    path = _summary_path()
    summary = json.loads(path.read_text()) if path.is_file() else {}
    summary[arch] = result
    path.write_text(json.dumps(summary, indent=2, sort_keys=True))


@pytest.mark.parametrize("arch", ["Eagle3DeepseekV2ForCausalLM", "LlamaForCausalLMEagle3"])
def test_sglang_logits_equal_training_forward(arch, tmp_path):
    import torch

    from specforge_kimi.drafts.export_engines import load_exported_draft

    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    export_dir = _export(arch, tmp_path)
    g = torch.Generator().manual_seed(1)
    input_ids = [torch.randint(0, VOCAB, (t,), generator=g) for t in LENGTHS]
    aux = [torch.randn(t, 3 * HIDDEN, generator=g).to(torch.bfloat16) for t in LENGTHS]
    embed = torch.load(tmp_path / "embed.pt")
    torch.save({"input_ids": input_ids, "aux": aux, "embed": embed}, tmp_path / "inputs.pt")

    proc = subprocess.run(
        [sys.executable, __file__, str(export_dir), str(tmp_path / "inputs.pt"), str(tmp_path / "sglang.pt"), BACKEND],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    result = {
        "backend": BACKEND,
        "lengths": list(LENGTHS),
        "returncode": proc.returncode,
        "tolerance": {"cos_min": COS_MIN, "rel_max": REL_MAX, "margin_min": MARGIN_MIN},
    }
    if proc.returncode != 0:
        result["stderr_tail"] = proc.stderr[-6000:]
        _record(arch, result)
        pytest.fail(f"SGLang forward failed (see {_summary_path()}):\n{proc.stderr[-3000:]}")
    sg = torch.load(tmp_path / "sglang.pt")

    model = load_exported_draft(export_dir, embedding=embed.float()).float().cuda().eval()
    per_seq, offset = [], 0
    for ids, a in zip(input_ids, aux, strict=False):
        t = ids.shape[0]
        got = sg["logits"][offset : offset + t].cuda()
        assert torch.equal(sg["positions"][offset : offset + t], torch.arange(t))
        offset += t
        ids, a = ids.cuda(), a.float().cuda()
        ref = _reference(model, arch, ids, a)
        rel = float((got - ref).norm() / ref.norm())
        cos = torch.nn.functional.cosine_similarity(got, ref, dim=-1)
        top1 = float((got.argmax(-1) == ref.argmax(-1)).float().mean())
        mutant_rel = {w: float((got - _reference(model, arch, ids, a, w)).norm() / ref.norm()) for w in MUTANTS[arch]}
        per_seq.append(
            {
                "T": t,
                "rel": rel,
                "cos_min": float(cos.min()),
                "top1_agreement": top1,
                "mutant_rel": mutant_rel,
                "margin_min": min(v / max(rel, 1e-12) for v in mutant_rel.values()),
            }
        )
    result["sequences"] = per_seq
    result["passed"] = all(
        s["cos_min"] >= COS_MIN and s["rel"] <= REL_MAX and s["margin_min"] >= MARGIN_MIN for s in per_seq
    )
    _record(arch, result)
    for s in per_seq:
        assert s["cos_min"] >= COS_MIN, s
        assert s["rel"] <= REL_MAX, s
        assert s["margin_min"] >= MARGIN_MIN, s


if __name__ == "__main__":  # the SGLang subprocess
    sglang_forward(*sys.argv[1:5])
