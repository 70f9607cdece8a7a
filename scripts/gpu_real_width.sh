#!/usr/bin/env bash
# The real-width rehearsal on one H200 (recipes/kimi-k25-slice-h200.yaml; RECIPE=recipes/kimi-k25-slice-h100.yaml on an H100): Kimi-K2.5's width and INT4 experts,
# 5 layers, co-located capture server + one trainer rank. The pinned stack on PYTHONPATH (GPU bundle) and this
# checkout's src/. Writes logs and JSON under ${OUT:-/tmp/real-width}.
#   STAGE=target  write the slice (random weights generated and INT4-quantized on the GPU by compressed-tensors)
#   STAGE=data    the slice's plain prefill timed on the data server (the fit's deep point), then N_PROMPTS (400)
#                 chat/math/code prompts of specforge_kimi.data.prompt_mix answered by the slice
#                 through SGLang (greedy, MAX_TOKENS 512 new tokens, thinking on, unfinished answers kept: a random
#                 target rarely stops), then prepare (draft vocab 32,000)
#   STAGE=depth   the slice's first 3 layers (2 MoE layers; its own files, hard-linked, config saying 3 layers) served
#                 with the data stage's flags, plain prefill timed (bench/prefill_depth.py: the fit's shallow point)
#   STAGE=train   specforge-kimi launch RECIPE --no-bench (GPU memory sampled per process), run-report, what is
#                 left on the GPU afterwards
#   STAGE=bench   bench/online_pipeline.py on the slice: capture/plain prefill at SHAPES
#                 (16x1024,4x4096,64x1024), capture write and reader rates, TRANSPORTS (mooncake), with the
#                 train stage's run-report (trainer-only and end-to-end tok/s, GPU memory per role)
# STAGE=all runs them in that order. The first INT4 prefill on a host JIT-compiles SGLang's Marlin MoE kernel
# (minutes; TVM_FFI_CACHE_DIR keeps it): point TVM_FFI_CACHE_DIR at a carried cache to skip it.
# usage: [RECIPE=...] [TRANSPORT=mooncake|cuda_ipc [IPC_POOL_GIB=N]] [MAX_STEPS=N] [STAGE=all|target|data|depth|train|bench]
#        [TRAINER_SET=key=value,...] [OUT=...] bash scripts/gpu_real_width.sh [LAUNCH_TIMEOUT_S]
# TRANSPORT / IPC_POOL_GIB / MAX_STEPS / TRAINER_SET run a copy of the recipe (OUT/recipe-run.yaml) with those changed;
# TRAINER_SET sets trainer fields, each value read as YAML (e.g. TRAINER_SET=step_empty_cache=true,fused_adamw=false,
# step_optimizer_fused_clip=false: SpecForge's allocator and optimizer). The copy is validated as the recipe is.
# After each call: bash scripts/keep_gpu_results.sh <files_at> <date>-real-width, then commit.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/real-width}"; mkdir -p "$OUT"
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
. scripts/gpu_common.sh  # launch_measured, stop_server_on_exit
T="${1:-540}"
RECIPE="${RECIPE:-recipes/kimi-k25-slice-h200.yaml}"
if [ -n "${TRANSPORT:-}${MAX_STEPS:-}${TRAINER_SET:-}" ]; then  # the same recipe on another transport / step count (a copy in OUT)
  python3 - "$RECIPE" "$OUT/recipe-run.yaml" <<'PY' || exit 2
import os, sys, yaml
raw = yaml.safe_load(open(sys.argv[1]))
if os.environ.get("TRANSPORT"):
    raw["server"]["transport"] = os.environ["TRANSPORT"]
    if os.environ["TRANSPORT"] == "cuda_ipc" and os.environ.get("IPC_POOL_GIB"):
        raw["server"]["ipc_pool_gib"] = float(os.environ["IPC_POOL_GIB"])
if os.environ.get("MAX_STEPS"):
    raw["trainer"]["max_steps"] = int(os.environ["MAX_STEPS"])
for item in filter(None, os.environ.get("TRAINER_SET", "").split(",")):
    key, sep, value = item.partition("=")
    if not sep or not key.strip():
        sys.exit(f"TRAINER_SET: {item!r} is not key=value")
    raw["trainer"][key.strip()] = yaml.safe_load(value)
open(sys.argv[2], "w").write(yaml.safe_dump(raw, sort_keys=False))
from specforge_kimi.errors import KimiInputError
from specforge_kimi.plan.run_plan import load_recipe
try:
    load_recipe(sys.argv[2])  # an unknown field or a bad value stops here, with the recipe's own one-line error
except KimiInputError as exc:
    sys.exit(f"error: {exc}")
PY
  RECIPE="$OUT/recipe-run.yaml"
fi
# the recipe's run folder, target, data folder, the result files' GPU label (h100, h200: its gpus.kind) and aux ids
# (SpecForge's, comma-joined), in one load (the aux ids last: an empty field between tabs would be lost)
IFS=$'\t' read -r RUN TARGET DATA GPU_TAG AUX < <(python3 -c "import sys, os; from specforge_kimi.plan.run_plan import load_recipe as l; r = l(sys.argv[1]); \
print(r.output_dir, r.target.path, os.path.dirname(r.data.prompts_path), r.gpus.kind.lower(), ','.join(map(str, r.target.aux_layer_ids or [])), sep='\t')" "$RECIPE") \
  || { echo "cannot load $RECIPE" >&2; exit 2; }
STAGE="${STAGE:-all}"
case "$STAGE" in all|target|data|depth|train|bench) ;; *) echo "STAGE must be all, target, data, depth, train or bench, not $STAGE" >&2; exit 2;; esac
stage() { [ "$STAGE" = all ] || [ "$STAGE" = "$1" ]; }
PORT=31998
write_slice() {  # dir layers log
  python3 -m specforge_kimi tiny "$1" --layers "$2" --hidden 7168 --heads 64 --experts 384 --experts-per-token 8 \
    --moe-intermediate 2048 --dense-intermediate 18432 --int4-experts --init-device "${INIT_DEVICE:-cuda}" \
    > "$3" 2>&1 || { tail -30 "$3"; exit 1; }
}
start_server() {  # dir log: a text-only server with the flags regeneration uses; sets SRV, waits for /health
  local T0; T0=$(date +%s)
  setsid python3 -m specforge_kimi.capture_server --model-path "$1" --tp-size 1 --host 127.0.0.1 --port $PORT \
    --attention-backend triton --disable-cuda-graph --mem-fraction-static 0.6 --reasoning-parser kimi_k2 \
    --chunked-prefill-size 65536 --max-prefill-tokens 65536 --served-model-name k25-slice > "$2" 2>&1 &
  SRV=$!
  stop_server_on_exit "$SRV"
  for _ in $(seq 1 "${SERVER_WAIT_S:-480}"); do curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break; sleep 1; done
  curl -sf "http://127.0.0.1:$PORT/health" >/dev/null || { echo "server for $1 not up; log:" >&2; tail -30 "$2" >&2; stop_server; exit 1; }
  echo "server for $1 up after $(( $(date +%s) - T0 )) s"
}
stop_server() { server_group_stop "$SRV"; trap - EXIT TERM INT; }

if stage target; then
  rm -rf "$TARGET"
  T0=$(date +%s)
  write_slice "$TARGET" 5 "$OUT/target.out"
  echo "target seconds=$(( $(date +%s) - T0 )) bytes=$(du -sb "$TARGET" | cut -f1)" | tee -a "$OUT/target.out"
  python3 -m specforge_kimi inspect "$TARGET" > "$OUT/inspect.json" || exit 1
fi

if stage data; then
  [ -f "$TARGET/config.json" ] || { echo "STAGE=data needs a target stage's $TARGET" >&2; exit 2; }
  rm -rf "$DATA" runs/slice-mix.jsonl runs/slice-mix-regen.jsonl*
  python3 - <<'PY' || exit 1
import json, os
from specforge_kimi.data import prompt_mix
with open("runs/slice-mix.jsonl", "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in prompt_mix.records(int(os.environ.get("N_PROMPTS", "400")), seed=0))
PY
  T0=$(date +%s)
  start_server "$TARGET" "$OUT/regen_server.log" > "$OUT/regenerate.out"
  python3 bench/prefill_depth.py --url "http://127.0.0.1:$PORT" --target "$TARGET" --shapes "${DEPTH_SHAPES:-4x4096,16x1024}" \
    --out "$OUT/prefill_depth_k25_slice5_${GPU_TAG}.json" >> "$OUT/regenerate.out" 2>&1
  python3 -m specforge_kimi regenerate runs/slice-mix.jsonl --server "http://127.0.0.1:$PORT" \
    --out runs/slice-mix-regen.jsonl --concurrency 128 --max-tokens "${MAX_TOKENS:-512}" --temperature 0 \
    --thinking on --keep-unfinished --no-progress >> "$OUT/regenerate.out" 2>&1
  echo "regenerate rc=$? seconds=$(( $(date +%s) - T0 ))" | tee -a "$OUT/regenerate.out"
  stop_server
  grep -E "Marlin|compressed|error|Error" "$OUT/regen_server.log" | head -20 > "$OUT/regen_server_evidence.txt"
  python3 -m specforge_kimi prepare runs/slice-mix-regen.jsonl --out "$DATA" --tokenizer "$TARGET" \
    --draft-vocab-size 32000 --no-progress > "$OUT/prepare.out" 2>&1 || { tail -30 "$OUT/prepare.out"; exit 1; }
  tail -5 "$OUT/prepare.out"
fi

if stage depth; then
  # the slice's first 3 layers, read from its own files (hard links: no disk, no writing): config.json says 3
  # layers and SGLang's loader skips the tensors of layers beyond them
  [ -f "$TARGET/config.json" ] || { echo "STAGE=depth needs a target stage's $TARGET" >&2; exit 2; }
  rm -rf runs/k25-slice3 && mkdir runs/k25-slice3 && ln "$TARGET"/* runs/k25-slice3/ 2>/dev/null
  rm runs/k25-slice3/config.json
  python3 - "$TARGET/config.json" runs/k25-slice3/config.json <<'PY' || exit 1
import json, sys
cfg = json.load(open(sys.argv[1]))
cfg["text_config"]["num_hidden_layers"] = 3
cfg["specforge_kimi_tiny"]["layers"] = 3
json.dump(cfg, open(sys.argv[2], "w"), indent=2)
PY
  start_server runs/k25-slice3 "$OUT/depth_server.log" > "$OUT/depth.out"
  python3 bench/prefill_depth.py --url "http://127.0.0.1:$PORT" --target runs/k25-slice3 --shapes "${DEPTH_SHAPES:-4x4096,16x1024}" \
    --out "$OUT/prefill_depth_k25_slice3_${GPU_TAG}.json" >> "$OUT/depth.out" 2>&1
  echo "prefill_depth rc=$?" >> "$OUT/depth.out"; cat "$OUT/depth.out"
  stop_server
  rm -rf runs/k25-slice3
fi

if stage train; then
  [ -f "$DATA/prompts.jsonl" ] || { echo "STAGE=train needs a data stage's $DATA" >&2; exit 2; }
  launch_measured "$RECIPE" "$RUN" "$OUT" "$T"
fi

if stage bench; then
  [ -f "$TARGET/config.json" ] || { echo "STAGE=bench needs a target stage's $TARGET" >&2; exit 2; }
  python3 bench/online_pipeline.py --target "$TARGET" --tp 1 --shapes "${SHAPES:-16x1024,4x4096,64x1024}" \
    --reps "${REPS:-3}" --compact-passthrough ${TRANSPORTS:+--transport $TRANSPORTS} ${IPC_POOL_GIB:+--ipc-pool-gib $IPC_POOL_GIB} \
    --workdir "$OUT/pipeline" --server-start-timeout "${SERVER_WAIT_S:-480}" --aux-ids "$AUX" \
    $([ -s "$OUT/online_run.json" ] && echo --run-report "$OUT/online_run.json") \
    --out "$OUT/online_pipeline_k25_slice_${GPU_TAG}.json" > "$OUT/online_pipeline.out" 2>&1
  echo "online_pipeline rc=$?" | tee -a "$OUT/online_pipeline.out"
  tail -40 "$OUT/online_pipeline.out"
fi
