#!/usr/bin/env bash
# Issue 44's tiny comparison on one GPU: an EAGLE-3 draft and its DFlash twin, each trained co-located for the same
# MAX_STEPS on the same tiny target and prepared data (scripts/gpu_online_run.sh's target and data stages with
# recipes/tiny-k25-tp1-h200.yaml), each served by SGLang and benched on the same prompts, then compared by
# bench/draft_comparison.py (like for like checked; acceptance length side by side, block / EAGLE-3, speedups, the
# trained target tokens of each run). With the pinned stack on PYTHONPATH (`. scripts/gpu_box.sh`).
#   STAGE=launch  both launches, one after the other (scripts/gpu_draft_run.sh STAGE=launch: listeners listed)
#   STAGE=bench   both benches (gpu_draft_run.sh STAGE=bench, BENCH_ARGS passed on), then the comparison once
#                 both acceptance files are in OUT (this call's or an earlier call's); the DFlash bench takes the
#                 EAGLE-3 bench's baseline (`bench --baseline-from`, checked like for like) when there is one, and
#                 serves its own if that is refused (rc 2), not after a failure or a cut
#   STAGE=all     both
#   FAMILIES="eagle3 dflash" (the default) the families either stage runs, in that order: one family per device
#                 call when a fresh box's launch (~260 s for 1,500 tiny steps with its start and export) or a bench
#                 (two SGLang servers each) leaves no room for the second
# The stages fit separate device calls. Results: OUT/eagle3/ and OUT/dflash/ (gpu_draft_run.sh's files, named
# with TAG tiny_<family>_tp1_<card>) and OUT/draft_comparison_tiny_tp1_<card>.json, where <card> is the GPU's model
# as nvidia-smi names it (h100, h200; else "gpu"), so every file says which card measured it.
# EAGLE3_RECIPE / BLOCK_RECIPE replace the two recipes (both must name the same target and data).
# usage: [OUT=/tmp/tiny-compare] [MAX_STEPS=1500] [STAGE=all|launch|bench] [FAMILIES="eagle3 dflash"] [BENCH_ARGS=...]
#        bash scripts/gpu_tiny_compare.sh [LAUNCH_TIMEOUT_S] [BENCH_TIMEOUT_S]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/tiny-compare}"
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"  # bench/draft_comparison.py writes through specforge_kimi.durable
STAGE="${STAGE:-all}"
MAX_STEPS="${MAX_STEPS:-1500}"
EAGLE3_RECIPE="${EAGLE3_RECIPE:-recipes/tiny-k25-tp1-h200.yaml}"
BLOCK_RECIPE="${BLOCK_RECIPE:-recipes/tiny-k25-tp1-h200-dflash.yaml}"
case "$STAGE" in all | launch | bench) ;; *) echo "STAGE must be all, launch or bench, not $STAGE" >&2; exit 2 ;; esac
FAMILIES="${FAMILIES:-eagle3 dflash}"
for f in $FAMILIES; do case "$f" in eagle3 | dflash) ;; *) echo "FAMILIES holds eagle3 and/or dflash, not $f" >&2; exit 2 ;; esac; done
[ -n "${FAMILIES// /}" ] || { echo "FAMILIES is empty" >&2; exit 2; }
[[ "$MAX_STEPS" =~ ^[1-9][0-9]*$ ]] || { echo "MAX_STEPS must be a positive integer, not $MAX_STEPS" >&2; exit 2; }
for r in "$EAGLE3_RECIPE" "$BLOCK_RECIPE"; do [ -f "$r" ] || { echo "no recipe $r" >&2; exit 2; }; done
CARD=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | grep -o 'H[0-9][0-9][0-9]' | head -1 | tr 'A-Z' 'a-z')
CARD="${CARD:-gpu}"
mkdir -p "$OUT"
echo "tiny comparison on $CARD: stage $STAGE, $MAX_STEPS steps each -> $OUT"

LAUNCH_T="${1:-420}"
BENCH_T="${2:-300}"
one() { # family recipe stage [extra bench flags]
  OUT="$OUT/$1" RECIPE="$2" TAG="tiny_$1_tp1_$CARD" STAGE="$3" MAX_STEPS="$MAX_STEPS" \
    BENCH_ARGS="${BENCH_ARGS:-}${4:+ $4}" bash scripts/gpu_draft_run.sh "$LAUNCH_T" "$BENCH_T"
}
bench_block() { # the DFlash bench, on the EAGLE-3 bench's baseline when it has one (one server start less)
  local eb="$OUT/eagle3/bench/bench_result.json"
  if python3 -c "import json, sys; sys.exit(not json.load(open(sys.argv[1])).get('baseline'))" "$eb" 2>/dev/null; then
    one dflash "$BLOCK_RECIPE" bench "--baseline-from $OUT/eagle3/bench"
    [ -f "$OUT/dflash/acceptance_tiny_dflash_tp1_$CARD.json" ] && return
    mv "$OUT/dflash/bench.out" "$OUT/dflash/bench-shared-baseline.out" 2>/dev/null
    if ! grep -q "^bench rc=2$" "$OUT/dflash/bench-shared-baseline.out" 2>/dev/null; then
      echo "the DFlash bench failed or was cut (OUT/dflash/bench-shared-baseline.out): not retried"
      return
    fi
    echo "the EAGLE-3 bench's baseline was refused (OUT/dflash/bench-shared-baseline.out): its own baseline"
  fi
  one dflash "$BLOCK_RECIPE" bench
}
if [ "$STAGE" != bench ]; then
  for f in $FAMILIES; do
    if [ "$f" = eagle3 ]; then one eagle3 "$EAGLE3_RECIPE" launch; else one dflash "$BLOCK_RECIPE" launch; fi
  done
fi
if [ "$STAGE" != launch ]; then
  for f in $FAMILIES; do
    if [ "$f" = eagle3 ]; then one eagle3 "$EAGLE3_RECIPE" bench; else bench_block; fi
  done
  e="$OUT/eagle3/acceptance_tiny_eagle3_tp1_$CARD.json"
  d="$OUT/dflash/acceptance_tiny_dflash_tp1_$CARD.json"
  runs=()
  re="$OUT/eagle3/online_run_tiny_eagle3_tp1_$CARD.json"
  rd="$OUT/dflash/online_run_tiny_dflash_tp1_$CARD.json"
  [ -f "$re" ] && [ -f "$rd" ] && runs=(--eagle3-run "$re" --block-run "$rd")
  if [ -f "$e" ] && [ -f "$d" ]; then
    python3 bench/draft_comparison.py --eagle3 "$e" --block "$d" "${runs[@]}" \
      --out "$OUT/draft_comparison_tiny_tp1_$CARD.json"
    echo "comparison rc=$?"
  else
    echo "comparison skipped: a bench result is missing ($e, $d)"
  fi
fi
exit 0
