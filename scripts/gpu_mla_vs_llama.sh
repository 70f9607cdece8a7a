#!/usr/bin/env bash
# Issue 5 on the GPU box, after scripts/gpu_offline_twin.sh: the MLA EAGLE-3 draft trained offline by
# SpecForge's trainer on the SAME captured features as the Llama-style offline twin (same prompts,
# capture server, vocab mapping, lr, TTT, seed, steps, global batch: MLA_RECIPE, default
# recipes/tiny-k25-tp2-h200x2-mla.yaml, differs from the twin's recipe only in its draft), exported for SGLang (layers.0.*), served by
# SGLang's kimi_k25_eagle3.py and benched like the twin; mla_vs_llama_engine.json sets the two
# acceptance lengths side by side. With PARITY=1, GPU PARITY_GPU (1) runs
# tests/gpu/test_draft_logits_parity.py meanwhile. Writes under ${OUT:-/tmp/mla-vs-llama}.
# usage: [MLA_RECIPE=...] [PARITY=0|1] [PARITY_GPU=1] bash scripts/gpu_mla_vs_llama.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/mla-vs-llama}"; mkdir -p "$OUT"
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
. scripts/gpu_common.sh  # recipe_fields, held_out_rows
SETS="${BENCH_SETS:-structured,chat,math,code}"
MLA_RECIPE="${MLA_RECIPE:-recipes/tiny-k25-tp2-h200x2-mla.yaml}"
read -r _ _ _ AUX < <(recipe_fields "$MLA_RECIPE") || { echo "cannot load $MLA_RECIPE" >&2; exit 2; }
[ -d runs/features-offline ] || { echo "no runs/features-offline: run scripts/gpu_offline_twin.sh first" >&2; exit 2; }
[ -f runs/bench-offline/bench_result.json ] || echo "note: no runs/bench-offline (the Llama twin's bench) to compare with" >&2
if [ "${PARITY:-0}" = 1 ]; then
  ( CUDA_VISIBLE_DEVICES="${PARITY_GPU:-1}" SPECFORGE_KIMI_GPU_OUT="$OUT/parity" python3 -m pytest tests/gpu/test_draft_logits_parity.py \
      --run-gpu -q > "$OUT/parity.out" 2>&1; echo "parity rc=$?" >> "$OUT/parity.out" ) &
  PAR=$!
fi
rm -rf runs/offline-mla runs/bench-mla
T0=$(date +%s)
CUDA_VISIBLE_DEVICES=0 python3 -m specforge_kimi train-offline "$MLA_RECIPE" \
  --features runs/features-offline --out runs/offline-mla > "$OUT/train_offline_mla.out" 2>&1
echo "train-offline mla rc=$? seconds=$(( $(date +%s) - T0 ))" | tee -a "$OUT/train_offline_mla.out"
CUDA_VISIBLE_DEVICES=0 python3 -m specforge_kimi bench --target runs/tiny-k25 --draft runs/offline-mla/export-sglang \
  --sets "$SETS" --num-prompts "${BENCH_PROMPTS:-16}" --max-new-tokens 128 --concurrency "${BENCH_CONCURRENCY:-4}" \
  --config 3,1,4 --min-acceptance-length 3.0 --disable-cuda-graph --mem-fraction-static 0.3 --no-baseline \
  --out runs/bench-mla > "$OUT/bench_mla.out" 2>&1
echo "bench mla rc=$?" | tee -a "$OUT/bench_mla.out"
OFFLINE_CKPT=$(ls -d runs/offline-twin/*-step* 2>/dev/null | sort -V | tail -1)
MLA_CKPT=$(ls -d runs/offline-mla/*-step* 2>/dev/null | sort -V | tail -1)
if [ -n "$MLA_CKPT" ]; then
  CUDA_VISIBLE_DEVICES=0 python3 -m specforge_kimi eval-draft --target runs/tiny-k25 \
    --draft-config runs/offline-mla/rendered/draft_config.json --vocab-mapping runs/tiny-k25-data/vocab_mapping.pt \
    --aux-ids "$AUX" --checkpoints "$MLA_CKPT" --heldout "$(held_out_rows)" --device cuda \
    $([ -s runs/heldout-regen.jsonl ] && echo --heldout-file runs/heldout-regen.jsonl) \
    --out "$OUT/eval_mla.json" > "$OUT/eval_mla.out" 2>&1
fi
cp runs/bench-mla/bench_result.json "$OUT/bench-mla.json" 2>/dev/null; cp runs/bench-mla/acceptance.png "$OUT/bench-mla.png" 2>/dev/null
cp runs/bench-offline/bench_result.json "$OUT/bench-llama-offline.json" 2>/dev/null
[ -n "${PAR:-}" ] && wait $PAR
MLA_RECIPE="$MLA_RECIPE" python3 - "$OUT" <<'PY'
import json, os, sys
from pathlib import Path
out = Path(sys.argv[1])
res = {"command": "MLA_RECIPE=" + os.environ["MLA_RECIPE"] + " bash scripts/gpu_mla_vs_llama.sh", "what": "SGLang acceptance at 3/1/4 of two drafts trained "
       "offline on the same captured features (same recipe but the draft)"}
for name, f in (("mla", "bench-mla.json"), ("llama", "bench-llama-offline.json")):
    p = out / f
    if p.is_file():
        r = json.loads(p.read_text())
        run = r["speculative"][0]
        res[name] = {"architectures": r["draft"].get("architectures"), "acceptance_length": run["overall"]["acceptance_length"],
                     "per_set": {k: v["acceptance_length"] for k, v in run["sets"].items()}}
if "mla" in res and "llama" in res:
    res["mla_minus_llama"] = res["mla"]["acceptance_length"] - res["llama"]["acceptance_length"]
(out / "mla_vs_llama_engine.json").write_text(json.dumps(res, indent=2))
print(json.dumps(res, indent=2))
PY
