#!/usr/bin/env bash
# One co-located run of RECIPE on the GPU box, then its acceptance bench: the draft families side by side on one
# target (an EAGLE-3 recipe and its block-draft twin, e.g. recipes/tiny-k25-tp1-h200.yaml and
# recipes/tiny-k25-tp1-h200-dflash.yaml, on the target and data that scripts/gpu_online_run.sh's target and data
# stages left in runs/). With the pinned stack on PYTHONPATH (`. scripts/gpu_box.sh`) and this checkout's src/.
#   1. `specforge-kimi launch RECIPE --no-bench` through gpu_common.sh's launch_measured (GPU memory per process,
#      what is left afterwards, the run's logs, run-report -> OUT/online_run.json, the export's config), with every
#      TCP listener of the launch's process tree listed while it runs (tests/listeners_during.py ->
#      OUT/listeners.json: address, port, process, loopback or not);
#   2. `specforge-kimi bench --recipe RECIPE --draft RUN/export-sglang --out OUT/bench` (the recipe's bench section:
#      EAGLE3 steps/topk/draft tokens or DFLASH block size; acceptance length, decode tok/s, speedup).
# TAG=NAME names the results as bench/results/ keeps them: OUT/online_run_NAME.json (run-report) and
# OUT/acceptance_NAME.json (the bench's bench_result.json).
# usage: RECIPE=recipes/...yaml [OUT=/tmp/draft-run] [TAG=NAME] bash scripts/gpu_draft_run.sh [LAUNCH_TIMEOUT_S] [BENCH_TIMEOUT_S]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/draft-run}"
mkdir -p "$OUT"
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
. scripts/gpu_common.sh # recipe_fields, launch_measured
[ -n "${RECIPE:-}" ] || { echo "RECIPE=recipes/...yaml is required" >&2; exit 2; }
T="${1:-420}"
TB="${2:-300}"
read -r NAME RUN _ _ < <(recipe_fields "$RECIPE") || { echo "cannot load $RECIPE" >&2; exit 2; }
echo "draft run: $NAME ($RECIPE) -> $RUN; results in $OUT"
rm -rf "$RUN" # one run at a time on the box's disk
python3 tests/listeners_during.py --out "$OUT/listeners.json" --interval 0.5 -- \
  bash -c '. scripts/gpu_common.sh && launch_measured "$0" "$1" "$2" "$3"' "$RECIPE" "$RUN" "$OUT" "$T"
tail -1 "$OUT/launch.out"
timeout --signal=INT "$TB" python3 -m specforge_kimi bench --recipe "$RECIPE" --draft "$RUN/export-sglang" \
  --out "$OUT/bench" > "$OUT/bench.out" 2>&1
echo "bench rc=$?" | tee -a "$OUT/bench.out"
tail -3 "$OUT/bench.out"
if [ -n "${TAG:-}" ]; then
  [ -f "$OUT/online_run.json" ] && mv "$OUT/online_run.json" "$OUT/online_run_${TAG}.json"
  [ -f "$OUT/bench/bench_result.json" ] && cp "$OUT/bench/bench_result.json" "$OUT/acceptance_${TAG}.json"
fi
exit 0
