# Sourced by the scripts/gpu_*.sh scripts (run from the repository root, src/ on PYTHONPATH).

# recipe_fields RECIPE: the recipe's name, output_dir, gpus.per_node and target.aux_layer_ids (SpecForge ids,
# comma-joined, as eval-draft's --aux-ids takes them) on one line (fails if it does not load)
recipe_fields() {
  python3 -c "import sys; from specforge_kimi.plan.run_plan import load_recipe as l; r = l(sys.argv[1]); \
print(r.name, r.output_dir, r.gpus.per_node, ','.join(map(str, r.target.aux_layer_ids or [])))" "$1"
}

# eval-draft takes every regenerated held-out row (48 corpus; with MIX + 48 prompt-mix + 48 bench prompts), else 48 corpus
held_out_rows() { if [ -s runs/heldout-regen.jsonl ]; then wc -l < runs/heldout-regen.jsonl; else echo 48; fi; }

# run_report RUN OUT: `specforge-kimi run-report RUN` -> OUT/online_run.json (its output in OUT/run_report.out), with
# the per-process GPU memory samples of OUT/gpu_mem_samples.csv when there are any
run_report() {
  local RUN="$1" OUT="$2" samples=()
  [ -f "$OUT/gpu_mem_samples.csv" ] && samples=(--gpu-samples "$OUT/gpu_mem_samples.csv")
  python3 -m specforge_kimi run-report "$RUN" "${samples[@]}" --out "$OUT/online_run.json" > "$OUT/run_report.out" 2>&1
}

# server_group_stop PID: stop a server started with setsid (its own session and process group) and wait for it
server_group_stop() {
  [ -n "${1:-}" ] || return 0
  kill -INT -- -"$1" 2>/dev/null; sleep 5; kill -KILL -- -"$1" 2>/dev/null; wait "$1" 2>/dev/null
}

# stop_server_on_exit PID: the setsid server PID goes with the script: a signal to the script's process group (a
# `timeout`, a device call's limit) never reaches a server in its own session, so without this a killed stage
# leaves it holding its GPU memory. server_group_stop PID; trap - EXIT TERM INT: the normal end
stop_server_on_exit() { trap "server_group_stop $1" EXIT; trap 'exit 143' TERM; trap 'exit 130' INT; }

# head_tail FILE DEST: FILE whole up to 60,000 bytes, else its first and last 30,000 bytes with one line between
# saying how much was left out (a server log's start-up and its end both matter)
head_tail() {
  local size
  size=$(stat -c %s "$1")
  if [ "$size" -le 60000 ]; then cat "$1" > "$2"; return; fi
  { head -c 30000 "$1"; printf '\n[... %d bytes left out ...]\n' $((size - 60000)); tail -c 30000 "$1"; } > "$2"
}

# launch_measured RECIPE RUN OUT TIMEOUT_S: `specforge-kimi launch RECIPE --no-bench` with the GPU memory of every
# process sampled every 2 s (OUT/gpu_mem_samples.csv), then what is left on the GPUs and in the process table
# (gpu_after.csv, procs_after.txt), the run's logs (head_tail), `run-report` (OUT/online_run.json) and the export's
# config (OUT/export-sglang/). Writes "launch rc=N" into OUT/launch.out. T0 (if set): the script's start.
launch_measured() {
  local RECIPE="$1" RUN="$2" OUT="$3" T="$4" T1 T2 RC SAMPLER
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
  echo "launch rc=$RC seconds=$((T2-T1)) prep_seconds=$((T1-${T0:-T1}))" | tee -a "$OUT/launch.out"
  sleep 5
  nvidia-smi --query-compute-apps=pid,used_memory --format=csv > "$OUT/gpu_after.csv" 2>&1
  nvidia-smi --query-gpu=index,memory.used --format=csv >> "$OUT/gpu_after.csv" 2>&1
  ps -eo pid,cmd | grep -E "sglang|specforge_kimi (train|launch)|specforge_kimi.capture_server|mooncake.cli|torch.distributed.run" | grep -v grep > "$OUT/procs_after.txt"
  # cuda_ipc: what a pool leaves (pool files under the run's ipc/, slot tables in /dev/shm) must be gone
  { ls "$RUN/ipc" 2>/dev/null; ls /dev/shm 2>/dev/null | grep '^sfk-ipc-'; } > "$OUT/ipc_after.txt"
  for f in "$RUN"/logs/*.log; do head_tail "$f" "$OUT/$(basename "$f")"; done
  ls -laR "$RUN" > "$OUT/run_tree.txt" 2>&1
  run_report "$RUN" "$OUT"
  cp -r "$RUN/export-sglang" "$OUT/" 2>/dev/null; rm -f "$OUT"/export-sglang/*.safetensors
  return 0
}
