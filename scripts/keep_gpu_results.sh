#!/usr/bin/env bash
# Keep what one GPU call brought back, in the repository, at once: the device tool's files_at folder is scratch
# space on this machine and does not outlive it. Run it right after each call, then commit.
#   result JSON (the names bench/ scripts give them: online_pipeline_*, prefill_depth_*, online_run*, capture_parity*,
#   trainer_memory_*, acceptance_*, eval_*, ...) -> bench/results/ (an existing file is not overwritten: rename first)
#   everything else that is text (logs, *.out, *.txt, small JSON such as inspect.json) -> archive/gpu-runs/logs/NAME/, each
#   file cut to its last 256 KiB; plots (*.png up to 4 MiB: run_*.png, soak_*.png) beside the logs, whole; other
#   binaries, checkpoints and tensors are left out and listed
# usage: bash scripts/keep_gpu_results.sh FILES_AT NAME      (NAME e.g. 2026-12-03-real-width)
#        KEEP_ROOT=DIR writes under DIR instead of this checkout (the tests use it)
set -euo pipefail
SRC_ABS="$(cd "${1:-.}" 2>/dev/null && pwd || true)"
cd "${KEEP_ROOT:-$(dirname "$0")/..}"
: "${1:?usage: keep_gpu_results.sh FILES_AT NAME}"; NAME="${2:?usage: keep_gpu_results.sh FILES_AT NAME}"
[ -n "$SRC_ABS" ] && [ -d "$SRC_ABS" ] || { echo "error: $1 is not a folder" >&2; exit 2; }
SRC="$SRC_ABS"
case "$NAME" in 20[0-9][0-9]-[01][0-9]-[0-3][0-9]-*) ;; *) echo "error: NAME must start with a date (2026-12-03-...), not $NAME" >&2; exit 2;; esac
LOGS="archive/gpu-runs/logs/$NAME"; mkdir -p "$LOGS" bench/results
RESULT='^(online_pipeline|prefill_depth|online_run|capture_parity|trainer_memory|trainer_step|acceptance|eval|sizing|draft_logits|fault_drills|bench_sglang|regenerate|target_select|tiny_target|offline_twin|mla_vs_llama|cuda_ipc|resume|soak|draft_comparison|overlap_rates|capture_overhead|pretrain_repro|cudnn_merged_backward)_?.*\.json$'
kept=0; logged=0; skipped=()
while IFS= read -r -d '' f; do
  rel="${f#"$SRC"/}"; base="$(basename "$f")"
  if [[ "$base" =~ $RESULT ]] && python3 -c "import json,sys; json.load(open(sys.argv[1]))" "$f" 2>/dev/null; then
    if [ -e "bench/results/$base" ] && ! cmp -s "$f" "bench/results/$base"; then
      echo "error: bench/results/$base exists and differs; rename $f first" >&2; exit 1
    fi
    cp "$f" "bench/results/$base"; kept=$((kept + 1))
  elif [[ "$base" == *.png ]] && [ "$(stat -c %s "$f")" -le 4194304 ]; then  # a plot: kept whole
    mkdir -p "$LOGS/$(dirname "$rel")"
    cp "$f" "$LOGS/$rel"; logged=$((logged + 1))
  elif python3 -c "import sys; b = open(sys.argv[1], 'rb').read(65536); sys.exit(b'\0' in b)" "$f"; then  # text
    mkdir -p "$LOGS/$(dirname "$rel")"
    tail -c 262144 "$f" > "$LOGS/$rel"; logged=$((logged + 1))
  else
    skipped+=("$rel")
  fi
done < <(find "$SRC" -type f -print0)
echo "kept $kept result file(s) in bench/results/, $logged log(s) in $LOGS/"
[ ${#skipped[@]} -eq 0 ] || printf 'left out (binary): %s\n' "${skipped[@]}"
echo "next: git add bench/results $LOGS && git commit (and record the call in archive/gpu-runs/RUNS.md and archive/README.md)"
