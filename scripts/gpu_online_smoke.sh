#!/usr/bin/env bash
# GPU smoke of the co-located online loop (issue 4b) on a 2-GPU box, with the pinned stack on
# PYTHONPATH (GPU bundle) and this checkout's src/. Writes logs under ${OUT:-/tmp/online-smoke}.
# usage: bash scripts/gpu_online_smoke.sh [LAUNCH_TIMEOUT_S]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/online-smoke}"; mkdir -p "$OUT"
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
T="${1:-240}"
rm -rf runs/tiny-k25 runs/tiny-k25-data runs/tiny-k25-tp2
python3 -m specforge_kimi tiny runs/tiny-k25 --layers 8 --hidden 512 || exit 1
python3 - <<'PY' || exit 1
import json
from specforge_kimi import corpus
with open("runs/corpus.jsonl", "w") as f:
    for r in corpus.conversations(2000, seed=0):
        f.write(json.dumps(r) + "\n")
PY
python3 -m specforge_kimi prepare runs/corpus.jsonl --out runs/tiny-k25-data --standin-tokenizer \
  --draft-vocab-size 8192 --no-progress || exit 1
python3 -m specforge_kimi launch recipes/tiny-k25-tp2-h200x2.yaml --plan > "$OUT/plan.json"
timeout --signal=INT "$T" python3 -m specforge_kimi launch recipes/tiny-k25-tp2-h200x2.yaml > "$OUT/launch.out" 2>&1
echo "launch rc=$?" | tee -a "$OUT/launch.out"
sleep 5; nvidia-smi --query-compute-apps=pid,used_memory --format=csv > "$OUT/gpu_after.csv" 2>&1
ps -eo pid,cmd | grep -E "sglang|specforge|mooncake" | grep -v grep > "$OUT/procs_after.txt"
for f in runs/tiny-k25-tp2/logs/*.log; do tail -c 20000 "$f" > "$OUT/$(basename "$f")"; done
ls -la runs/tiny-k25-tp2 runs/tiny-k25-tp2/* > "$OUT/run_tree.txt" 2>&1
