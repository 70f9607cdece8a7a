#!/usr/bin/env bash
# GPU run of the co-located online loop (issue 4b-d) on a 2-GPU box, with the pinned stack on
# PYTHONPATH (GPU bundle) and this checkout's src/. Writes logs and JSON under ${OUT:-/tmp/online-run}.
#   1. tiny K2.5 (8 layers, hidden 512) pretrained on the GPU on the structured corpus (60 s)
#   2. 2,000 corpus conversations -> prepare (draft vocab 256)
#   3. specforge-kimi launch recipes/tiny-k25-tp2-h200x2.yaml (Mooncake + TP=2 capture server +
#      producer + 2 trainer ranks on GPUs 0,1; export at the end), GPU memory sampled per process
#   4. eval-draft: simulated acceptance of the untrained draft and every checkpoint (held-out)
#   5. disk bytes per trained token; processes and GPU memory left after the run
# usage: bash scripts/gpu_online_run.sh [LAUNCH_TIMEOUT_S]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/online-run}"; mkdir -p "$OUT"
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
T="${1:-420}"
RECIPE=recipes/tiny-k25-tp2-h200x2.yaml
RUN=runs/tiny-k25-tp2
rm -rf runs/tiny-k25 runs/tiny-k25-data "$RUN"
T0=$(date +%s)
python3 -m specforge_kimi tiny runs/tiny-k25 --layers 8 --hidden 512 --pretrain 60 --device cuda \
  > "$OUT/tiny.out" 2>&1 || { tail -30 "$OUT/tiny.out"; exit 1; }
cp runs/tiny-k25/pretrain.json runs/tiny-k25/pretrain_loss.png "$OUT/" 2>/dev/null
python3 - <<'PY' || exit 1
import json
from specforge_kimi import corpus
with open("runs/corpus.jsonl", "w") as f:
    for r in corpus.conversations(2000, seed=0):
        f.write(json.dumps(r) + "\n")
PY
python3 -m specforge_kimi prepare runs/corpus.jsonl --out runs/tiny-k25-data --tokenizer runs/tiny-k25 \
  --draft-vocab-size 256 --no-progress > "$OUT/prepare.out" 2>&1 || { cat "$OUT/prepare.out"; exit 1; }
T1=$(date +%s)
python3 -m specforge_kimi launch "$RECIPE" --plan > "$OUT/plan.json"
( while sleep 2; do
    nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits 2>/dev/null |
    while IFS=', ' read -r pid mem; do
      echo "$(date +%s),$pid,$mem,$(tr '\0' ' ' < /proc/$pid/cmdline 2>/dev/null | cut -c1-160)"
    done
  done ) > "$OUT/gpu_mem_samples.csv" &
SAMPLER=$!
timeout --signal=INT "$T" python3 -m specforge_kimi launch "$RECIPE" --no-bench > "$OUT/launch.out" 2>&1
RC=$?
T2=$(date +%s)
kill $SAMPLER 2>/dev/null
echo "launch rc=$RC seconds=$((T2-T1)) prep_seconds=$((T1-T0))" | tee -a "$OUT/launch.out"
sleep 5
nvidia-smi --query-compute-apps=pid,used_memory --format=csv > "$OUT/gpu_after.csv" 2>&1
nvidia-smi --query-gpu=index,memory.used --format=csv >> "$OUT/gpu_after.csv" 2>&1
ps -eo pid,cmd | grep -E "sglang|specforge_kimi (train|launch)|specforge_kimi.capture_server|mooncake.cli|torch.distributed.run" | grep -v grep > "$OUT/procs_after.txt"
for f in "$RUN"/logs/*.log; do tail -c 30000 "$f" > "$OUT/$(basename "$f")"; done
ls -laR "$RUN" > "$OUT/run_tree.txt" 2>&1
CKPTS=$(ls -d "$RUN"/tiny-k25-tp2-step* 2>/dev/null | sort -V)
if [ -n "$CKPTS" ]; then
  python3 -m specforge_kimi eval-draft --target runs/tiny-k25 --draft-config "$RUN/rendered/draft_config.json" \
    --vocab-mapping runs/tiny-k25-data/vocab_mapping.pt --aux-ids 1,3,4 --checkpoints $CKPTS \
    --heldout 48 --device cuda --out "$OUT/eval_draft.json" > "$OUT/eval_draft.out" 2>&1
fi
python3 -m specforge_kimi run-report "$RUN" --gpu-samples "$OUT/gpu_mem_samples.csv" --out "$OUT/online_run.json" \
  > "$OUT/run_report.out" 2>&1
cat "$OUT/run_report.out" "$OUT/eval_draft.out" 2>/dev/null | grep -v Warning | tail -60
cp -r "$RUN/export-sglang" "$OUT/" 2>/dev/null; rm -f "$OUT"/export-sglang/*.safetensors
mkdir -p /tmp/online-run && cp "$OUT"/online_run.json "$OUT"/eval_draft.json /tmp/online-run/ 2>/dev/null; true
