# Sourced on a bare GPU box that has Python 3.12 and torch but not the pinned stack (the device machine):
# gathers the GPU bundle's parts carried by earlier calls, unpacks it once, applies SGLang patch spec-capture-cuda-ipc and our
# SpecForge patches from this tree, unpacks a carried TVM-FFI JIT cache (SGLang's Marlin MoE kernel: minutes to build otherwise), and copies
# this tree to /tmp/proj (its runs/ kept across calls), leaving the shell there with the stack on PYTHONPATH.
#   . scripts/gpu_box.sh stash FILE...   copy carried files (bundle parts, unpack.sh, the zstandard wheel, the
#                                        JIT cache .tgz) into /tmp/gb; nothing else
#   . scripts/gpu_box.sh                 the rest, once the last part is in /tmp/gb (idempotent: a second call
#                                        re-copies the tree and re-exports the variables only)
# The bundle: ../shared/gpu-bundle/build.sh (NOTES.md "GPU campaigns" has its patch list); spec-capture-cuda-ipc is applied here so that
# the bundle need not be rebuilt when it changes. Results: write under $OUT (tar a folder: 8 files come back).
_gb_main() {
  local src dest=/tmp/gpu-site
  src="$(pwd)"
  if [ "${1:-}" = stash ]; then
    shift
    mkdir -p /tmp/gb && cp "$@" /tmp/gb/ && ls -la /tmp/gb
    return
  fi
  [ -f /tmp/gb/unpack.sh ] || { echo "gpu_box: /tmp/gb/unpack.sh missing: stash the bundle first" >&2; return 2; }
  # unpack.sh reads its destination from $1: name it, or a sourced script's own $1 leaks in
  . /tmp/gb/unpack.sh "$dest" >/dev/null || { echo "gpu_box: unpack failed" >&2; return 2; }
  [ -f "$dest/site/sglang/srt/spec_capture_sink.py" ] || { echo "gpu_box: no capture patch in the bundle" >&2; return 2; }
  local ipc_patch="$src/patches/sglang/0.5.14/0005-spec-capture-cuda-ipc.patch"
  if patch -p2 -d "$dest/site" --forward --dry-run -s < "$ipc_patch" >/dev/null 2>&1; then
    patch -p2 -d "$dest/site" --forward -s --no-backup-if-mismatch < "$ipc_patch" \
      && echo "gpu_box: SGLang patch spec-capture-cuda-ipc applied"
  elif patch -p2 -d "$dest/site" --reverse --dry-run -s < "$ipc_patch" >/dev/null 2>&1; then
    echo "gpu_box: SGLang patch spec-capture-cuda-ipc already applied"
  else
    echo "gpu_box: SGLang patch spec-capture-cuda-ipc does not apply to the bundle" >&2; return 2
  fi
  # our SpecForge patches (-p1 into the bundle's site): those the bundle was built without, e.g.
  # eagle3-keep-allocator-cache and bf16-optimizer-fused-adamw
  local sp name
  for sp in "$src"/patches/specforge/0.2.0/*.patch; do
    name=$(basename "$sp" .patch); name=${name#[0-9][0-9][0-9][0-9]-}  # the patch's name: no order prefix
    if patch -p1 -d "$dest/site" --forward --dry-run -s < "$sp" >/dev/null 2>&1; then
      patch -p1 -d "$dest/site" --forward -s --no-backup-if-mismatch < "$sp" && echo "gpu_box: SpecForge patch $name applied"
    elif ! patch -p1 -d "$dest/site" --reverse --dry-run -s < "$sp" >/dev/null 2>&1; then
      echo "gpu_box: SpecForge patch $name does not apply to the bundle" >&2; return 2
    fi
  done
  local cache
  cache=$(ls /tmp/gb/tvm-cache-*.tgz 2>/dev/null | head -1)
  if [ -n "$cache" ] && [ ! -d /tmp/tvm ]; then tar -C /tmp -xzf "$cache"; fi
  [ -d /tmp/tvm ] && export TVM_FFI_CACHE_DIR=/tmp/tvm
  mkdir -p /tmp/proj
  if [ "$src" != /tmp/proj ]; then
    tar -C "$src" --exclude=./runs --exclude='./.gpu-*' --exclude=./.git --exclude=./.venv -cf - . | tar -C /tmp/proj -xf -
  fi
  cd /tmp/proj || return 2
  export PYTHONPATH="/tmp/proj/src:$PYTHONPATH" PYTHONUNBUFFERED=1
  echo "gpu_box: stack on PYTHONPATH, tree in /tmp/proj, TVM_FFI_CACHE_DIR=${TVM_FFI_CACHE_DIR:-unset}"
}
_gb_main "$@"
