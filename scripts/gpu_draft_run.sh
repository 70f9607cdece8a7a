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
# STAGE=launch runs step 1 only, STAGE=bench step 2 only on what a launch stage left in RUN (the two fit separate
# device calls). A launch cut after a checkpoint but before its export (its time limit) is exported by the bench
# stage first (`specforge-kimi export --recipe`, OUT/export.out), and its run report written if the cut took it.
# An earlier bench's OUT/bench (and its acceptance JSON) moves to OUT/bench-before-N first.
# MAX_STEPS=N runs a copy of the recipe (OUT/recipe-run.yaml) with trainer.max_steps N (both drafts of a comparison
# the same). BENCH_ARGS is appended to the bench's command line: the flags about how to run the measurement (e.g. "--num-prompts 8
# --no-baseline", --sets, --max-new-tokens, --concurrency, --disable-cuda-graph, --server-arg=...; bench --help's
# --recipe lists them); a flag the recipe sets (--config, --tp, --target, ...) stops the bench with one error line.
# usage: RECIPE=recipes/...yaml [OUT=/tmp/draft-run] [TAG=NAME] [STAGE=all|launch|bench] [MAX_STEPS=N] [BENCH_ARGS=...]
#        bash scripts/gpu_draft_run.sh [LAUNCH_TIMEOUT_S] [BENCH_TIMEOUT_S]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/draft-run}"
mkdir -p "$OUT"
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
. scripts/gpu_common.sh # recipe_fields, launch_measured
[ -n "${RECIPE:-}" ] || { echo "RECIPE=recipes/...yaml is required" >&2; exit 2; }
T="${1:-420}"
TB="${2:-300}"
STAGE="${STAGE:-all}"
case "$STAGE" in all | launch | bench) ;; *) echo "STAGE must be all, launch or bench, not $STAGE" >&2; exit 2 ;; esac
if [ -n "${MAX_STEPS:-}" ]; then # the same recipe with another step count, validated before anything starts
  python3 - "$RECIPE" "$MAX_STEPS" "$OUT/recipe-run.yaml" <<'PY' || exit 2
import sys, yaml
from specforge_kimi.errors import KimiInputError
from specforge_kimi.plan.run_plan import compile_plan
raw = yaml.safe_load(open(sys.argv[1]))
if not sys.argv[2].isdigit() or int(sys.argv[2]) < 1:
    sys.exit(f"MAX_STEPS must be a positive integer, not {sys.argv[2]!r}")
raw["trainer"]["max_steps"] = int(sys.argv[2])
try:
    compile_plan(raw)
except KimiInputError as e:
    sys.exit(str(e))
with open(sys.argv[3], "w") as f:
    yaml.safe_dump(raw, f, sort_keys=False)
PY
  RECIPE="$OUT/recipe-run.yaml"
fi
read -r NAME RUN _ _ < <(recipe_fields "$RECIPE") || { echo "cannot load $RECIPE" >&2; exit 2; }
echo "draft run: $NAME ($RECIPE, stage $STAGE) -> $RUN; results in $OUT"
if [ "$STAGE" != bench ]; then
  rm -rf "$RUN" # one run at a time on the box's disk
  python3 tests/listeners_during.py --out "$OUT/listeners.json" --interval 0.5 -- \
    bash -c '. scripts/gpu_common.sh && launch_measured "$0" "$1" "$2" "$3"' "$RECIPE" "$RUN" "$OUT" "$T"
  tail -1 "$OUT/launch.out"
fi
if [ "$STAGE" != launch ]; then
  if [ ! -f "$RUN/export-sglang/config.json" ] && [ -d "$RUN" ]; then
    # a launch cut after a checkpoint (its time limit, a kill) left no export: export its newest checkpoint as
    # launch would (`export --recipe`); the run report's last_step says how far it trained
    python3 -m specforge_kimi export --recipe "$RECIPE" > "$OUT/export.out" 2>&1
    echo "export rc=$? (the launch left no export; its newest checkpoint exported)" | tee -a "$OUT/export.out"
  fi
  if [ ! -f "$OUT/online_run.json" ] && [ ! -f "$OUT/online_run_${TAG:-}.json" ] && [ -d "$RUN" ]; then
    run_report "$RUN" "$OUT"
  fi
  if [ -e "$OUT/bench" ]; then # an earlier bench's files (a cut or refused one) kept aside, never taken for this one's
    n=1; while [ -e "$OUT/bench-before-$n" ]; do n=$((n + 1)); done
    mv "$OUT/bench" "$OUT/bench-before-$n"
    [ -z "${TAG:-}" ] || [ ! -f "$OUT/acceptance_${TAG}.json" ] || mv "$OUT/acceptance_${TAG}.json" "$OUT/bench-before-$n/"
  fi
  # shellcheck disable=SC2086 # BENCH_ARGS is a list of flags
  timeout --signal=INT "$TB" python3 -m specforge_kimi bench --recipe "$RECIPE" --draft "$RUN/export-sglang" \
    --out "$OUT/bench" ${BENCH_ARGS:-} > "$OUT/bench.out" 2>&1
  echo "bench rc=$?" | tee -a "$OUT/bench.out"
  tail -3 "$OUT/bench.out"
fi
if [ -n "${TAG:-}" ]; then
  [ -f "$OUT/online_run.json" ] && mv "$OUT/online_run.json" "$OUT/online_run_${TAG}.json"
  [ -f "$OUT/bench/bench_result.json" ] && cp "$OUT/bench/bench_result.json" "$OUT/acceptance_${TAG}.json"
fi
exit 0
