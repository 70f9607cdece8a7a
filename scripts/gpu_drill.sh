#!/usr/bin/env bash
# One device call of the GPU resilience drills (tests/gpu/test_resume_gpu.py, test_faults_gpu.py, test_soak_gpu.py),
# run on the device box from /tmp/proj after `. scripts/gpu_box.sh`:
#   bash scripts/gpu_drill.sh NAME SECONDS TEST_FILE [PYTEST_ARGS...]
# runs `python3 -m pytest TEST_FILE PYTEST_ARGS --run-gpu -q -rA` under `timeout SECONDS` with
# SPECFORGE_KIMI_GPU_OUT=/tmp/r/NAME (a second call with the same NAME merges into the same result files) and
# pytest's basetemp /tmp/pt/NAME; records the GPU's compute processes, /dev/shm and the drill's processes before and
# after (box_before.txt, box_after.txt); stops whatever of the drill outlived it (listed in box_after.txt first);
# copies the runs' text logs (not checkpoints or tensors) beside the results and tars /tmp/r/NAME into $OUT/NAME.tgz
# (one file: $OUT returns at most 8). Keep it at once: untar, then scripts/keep_gpu_results.sh.
# No -x unless the caller adds it: every test of the call runs; what a failed one left running is stopped here
# after the call (listed in box_after.txt first), so the next call starts on a clean box.
set -uo pipefail
name=${1:?usage: gpu_drill.sh NAME SECONDS TEST_FILE [PYTEST_ARGS...]}
secs=${2:?usage: gpu_drill.sh NAME SECONDS TEST_FILE [PYTEST_ARGS...]}
shift 2
r=/tmp/r/$name pt=/tmp/pt/$name
mkdir -p "$r" /tmp/pt
pattern='sglang|specforge|mooncake|torchrun|capture_server'
snap() {
  {
    date -u +%FT%TZ
    echo "-- nvidia-smi compute apps (pid, name, MiB)"
    nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader
    echo "-- /dev/shm"
    ls -la /dev/shm
    echo "-- drill processes"
    ps -eo pid,ppid,etimes,args | grep -E "$pattern" | grep -v -E "grep|gpu_drill" || true
  } > "$r/box_$1.txt" 2>&1
}
snap before
t0=$(date +%s)
SPECFORGE_KIMI_GPU_OUT=$r timeout -k 10 "$secs" python3 -m pytest "$@" --run-gpu -q -rA -p no:cacheprovider \
  --basetemp="$pt" > "$r/pytest.out" 2>&1
rc=$?
echo "rc=$rc wall_s=$(( $(date +%s) - t0 ))" >> "$r/pytest.out"
sleep 3
snap after
left=$(ps -eo pid,args | grep -E "$pattern" | grep -v -E "grep|gpu_drill" | awk '{print $1}')
[ -z "$left" ] || kill -9 $left 2>/dev/null
if [ -d "$pt" ]; then
  (cd "$pt" && find . -type f \( -name '*.log' -o -name '*.jsonl' -o -name '*.yaml' -o -name 'events*' \) -size -8M \
    -print0 | tar --null -T - -cf - | { mkdir -p "$r/runs" && tar -C "$r/runs" -xf -; })
fi
tar -C /tmp/r -czf "${OUT:-/tmp}/$name.tgz" "$name"
tail -n 30 "$r/pytest.out"
