"""`specforge-kimi bench` through real SGLang EAGLE-3 speculative decoding (GPU, marker gpu).

A tiny K2.5 is pretrained on the GPU on the structured corpus (``tiny --pretrain``'s function,
~40 s); the draft is either passed in (``SPECFORGE_KIMI_BENCH_TARGET`` +
``SPECFORGE_KIMI_BENCH_DRAFT``, e.g. the demo's ``runs/demo/target`` and
``runs/demo/export-sglang``) or an *untrained* EAGLE-3 draft: random initialisation from
SpecForge's own draft class, saved as a training state and exported by SpecForge's own SGLang
exporter plus our ``finalize_sglang_export`` -- nothing trained. Then the bench runs with small
settings (structured + chat sets, 8 prompts each, 64 new tokens, config 3/1/4, baseline on).
Checked: the result JSON's fields, the engine's counters are self-consistent (histogram covers
every verify step and accepted token), acceptance length >= 1.0 (an untrained draft sits near 1).
Summary to ``$SPECFORGE_KIMI_GPU_OUT/bench_sglang.json`` when set.
"""

import json
import os
import shutil
from collections import Counter
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

OUT = Path(os.environ.get("SPECFORGE_KIMI_GPU_OUT", "/tmp/specforge-kimi-gpu"))
START_TIMEOUT = float(os.environ.get("SPECFORGE_KIMI_SERVER_START_TIMEOUT", "420"))


def untrained_draft(target_dir: Path, out_dir: Path, work: Path) -> Path:
    """A random-weight Llama EAGLE-3 draft for ``target_dir`` in SGLang's format (SpecForge's export)."""
    import torch
    from specforge.modeling.auto import AutoDraftModel, AutoDraftModelConfig

    import specforge_kimi
    from specforge_kimi.data import corpus
    from specforge_kimi.data.corpus import TRAIN_SEED
    from specforge_kimi.data.tokenizer import build_standin_tokenizer
    from specforge_kimi.data.vocab_mapping import build_vocab_mapping, emitted_special_ids, save_vocab_mapping
    from specforge_kimi.demo.pipeline import _draft_config, _rows
    from specforge_kimi.drafts.export import export_sglang, finalize_sglang_export
    from specforge_kimi.targets.checkpoint import inspect_target
    from specforge_kimi.targets.layer_ids import AuxLayers, default_specforge_ids

    specforge_kimi.register()
    work.mkdir(parents=True, exist_ok=True)
    info = inspect_target(target_dir)
    rows = _rows(list(corpus.conversations(2000, seed=TRAIN_SEED)), build_standin_tokenizer())
    counts = Counter(t for ids, mask in rows for t, m in zip(ids, mask, strict=True) if m)
    draft_vocab = len(set(counts) | set(emitted_special_ids()))
    mapping = build_vocab_mapping(
        counts, draft_vocab_size=draft_vocab, target_vocab_size=info.vocab_size, source={"test": "untrained draft"}
    )
    vm = save_vocab_mapping(mapping, work / "vocab_mapping.pt")
    aux = AuxLayers.from_specforge(default_specforge_ids(info.num_layers), info.num_layers)
    cfg_path = work / "draft_config.json"
    cfg_path.write_text(json.dumps(_draft_config(info.hidden_size, draft_vocab, aux.specforge_ids())))
    torch.manual_seed(0)
    model = AutoDraftModel.from_config(AutoDraftModelConfig.from_file(str(cfg_path)), torch_dtype=torch.bfloat16)
    state = {k: v for k, v in model.state_dict().items() if "embed" not in k.lower()}
    torch.save({"strategy": "eagle3", "draft_state_dict": state}, work / "training_state.pt")
    export_sglang(str(work / "training_state.pt"), str(cfg_path), str(out_dir), str(vm))
    finalize_sglang_export(out_dir, target_dir=target_dir, aux=aux, extra={"untrained": True})
    return out_dir


def test_bench_against_sglang(tmp_path):
    from specforge_kimi.demo.pretrain import pretrain_structured_target
    from specforge_kimi.evaluate.bench import BenchSettings, SpecConfig, run_bench
    from specforge_kimi.targets.tiny import TinySpec

    given_target = os.environ.get("SPECFORGE_KIMI_BENCH_TARGET")
    given_draft = os.environ.get("SPECFORGE_KIMI_BENCH_DRAFT")
    if given_target and given_draft:
        target, draft, pre = Path(given_target), Path(given_draft), None
    else:
        target = tmp_path / "tiny"
        # 8 layers / hidden 512 (the recipes' tiny target), pretrained on the GPU
        pre = pretrain_structured_target(target, TinySpec(), seconds=40, device="cuda", progress=False)
        draft = untrained_draft(target, tmp_path / "draft", tmp_path / "draft-work")
    settings = BenchSettings(
        target=str(target),
        draft=str(draft),
        configs=[SpecConfig(3, 1, 4)],
        sets=["structured", "chat"],
        num_prompts=8,
        max_new_tokens=64,
        concurrency=2,
        warmup=1,
        mem_fraction_static=0.3,
        disable_cuda_graph=True,
        start_timeout_s=START_TIMEOUT,
        standin_tokenizer=True,
        min_acceptance_length=1.0,
        threshold_sets=["structured"],
        out_dir=str(tmp_path / "bench"),
    )
    try:
        result = run_bench(settings)
    finally:
        if (tmp_path / "bench" / "logs").exists():
            OUT.mkdir(parents=True, exist_ok=True)
            shutil.copytree(tmp_path / "bench" / "logs", OUT / "bench_logs", dirs_exist_ok=True)
    OUT.mkdir(parents=True, exist_ok=True)
    shutil.copy(tmp_path / "bench" / "bench_result.json", OUT / "bench_result.json")
    shutil.copy(tmp_path / "bench" / "acceptance.png", OUT / "acceptance.png")

    assert result["benchmark"] == "acceptance" and result["schema_version"] == 1
    assert result["baseline"]["overall"]["completion_tokens"] > 0
    run = result["speculative"][0]
    assert run["config"] == {"steps": 3, "topk": 1, "draft_tokens": 4}
    assert "--speculative-algorithm" in run["server_argv"] and "--enable-spec-capture" not in run["server_argv"]
    for name in ("structured", "chat"):
        s = run["sets"][name]
        assert s["requests"] == 8 and s["spec_verify_ct"] > 0, s
        assert s["histogram_consistent"], s
        assert 1.0 <= s["acceptance_length_decode"] <= 4.0, s
        assert s["acceptance_length"] >= 1.0, s
        assert len(s["per_position"]["at_least"]) == 3
    assert run["speedup"]["overall"] is not None
    assert result["threshold"]["passed"], result["threshold"]
    summary = {
        "target": str(target),
        "draft": str(draft),
        "untrained_draft": pre is not None,
        "pretrain": None
        if pre is None
        else {
            "steps": pre["train"]["steps"],
            "loss_first": pre["train"]["loss_first"],
            "loss_last": pre["train"]["loss_last"],
            "heldout": pre["heldout"],
        },
        "startup_s": {"baseline": result["baseline"]["startup_s"], "eagle3": run["startup_s"]},
        "sets": {
            n: {
                k: s.get(k)
                for k in (
                    "acceptance_length",
                    "acceptance_length_decode",
                    "accept_rate",
                    "output_tok_per_s",
                    "per_position",
                    "correct_drafts_histogram",
                )
            }
            for n, s in run["sets"].items()
        },
        "baseline_tok_per_s": {n: s["output_tok_per_s"] for n, s in result["baseline"]["sets"].items()},
        "speedup": run["speedup"],
        "output_match": run["output_match"],
        "server_info_avg_spec_accept_length": run["server_info_avg_spec_accept_length"],
        "wall_s": result["wall_s"],
    }
    (OUT / "bench_sglang.json").write_text(json.dumps(summary, indent=2))
