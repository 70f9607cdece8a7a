#!/usr/bin/env bash
# Set up .venv with the pinned stack (specforge==0.2.0 -> torch 2.11.0, transformers 5.8.1,
# sglang 0.5.14) and specforge-kimi installed editable. Idempotent: a venv whose install stamp
# matches pyproject.toml is reused. Python 3.11 or 3.12 (python3 on PATH, or $PYTHON).
#
# GPU hosts: bash scripts/bootstrap.sh --gpu [--specforge-checkout DIR] [--cuda 12|13] [--torch-index URL]
#                                           [--venv DIR] [--specforge-dir DIR] [--no-install]
#   the same stack with Mooncake's CUDA build for the CUDA that torch was built for (pyproject extra `gpu`:
#   CUDA 13, `gpu-cu12`: CUDA 12; a CPU build found in the venv is removed), SpecForge's source at the pinned
#   commit (git clone of $SPECFORGE_REPO, default https://github.com/sgl-project/SpecForge, into
#   --specforge-dir, default .specforge/SpecForge; or the checkout --specforge-checkout names), then
#   `specforge-kimi setup` (SpecForge's SGLang capture patch and ours into the installed sglang, our patches
#   into the installed specforge), and ends with `specforge-kimi doctor`, whose exit code it returns.
#   --torch-index installs torch 2.11.0 from that index first (e.g. https://download.pytorch.org/whl/cu130);
#   --no-install uses the environment as it is (e.g. an offline bundle) and only fetches, patches and checks.
set -euo pipefail
cd "$(dirname "$0")/.."
GPU=0 INSTALL=1 VENV=.venv CUDA_MAJOR="" TORCH_INDEX="" SF_CHECKOUT="" SF_DIR=.specforge/SpecForge
while [ $# -gt 0 ]; do
  case "$1" in
    --gpu) GPU=1; shift;;
    --no-install) INSTALL=0; shift;;
    --venv) VENV="$2"; shift 2;;
    --cuda) CUDA_MAJOR="$2"; shift 2;;
    --torch-index) TORCH_INDEX="$2"; shift 2;;
    --specforge-checkout) SF_CHECKOUT="$2"; shift 2;;
    --specforge-dir) SF_DIR="$2"; shift 2;;
    -h|--help) sed -n 2,16p "$0"; exit 0;;
    *) echo "bootstrap.sh: unknown argument $1 (see --help)" >&2; exit 2;;
  esac
done
if [ "$GPU" = 0 ] && { [ "$INSTALL" = 0 ] || [ "$VENV" != .venv ] || [ -n "$CUDA_MAJOR$TORCH_INDEX$SF_CHECKOUT" ]; }; then
  echo "bootstrap.sh: these options are for GPU hosts; add --gpu" >&2; exit 2
fi
PY="${PYTHON:-python3}"
"$PY" -c 'import sys; assert (3, 11) <= sys.version_info[:2] <= (3, 12), sys.version' \
  || { echo "specforge-kimi needs Python 3.11 or 3.12 (set PYTHON=...)" >&2; exit 2; }
# Mooncake's binaries (master, transfer engine) link libibverbs even in the CPU build
if ! ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1'; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "installing libibverbs1 (Mooncake needs it) ..."
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends libibverbs1; } >/dev/null \
      || { echo "apt-get install libibverbs1 failed; install it, Mooncake's master cannot start without it" >&2; exit 2; }
  else
    echo "libibverbs.so.1 is missing (Mooncake needs it): install libibverbs1 (Debian/Ubuntu) or rdma-core" >&2; exit 2
  fi
fi

# pip, quiet but for its errors; its exit status, not grep's, decides (set -e stops the script on a failed install)
pip_run() {
  local py="$1" rc; shift
  set +e; "$py" -m pip "$@" 2>&1 | grep -v '^WARNING: Location'; rc=${PIPESTATUS[0]}; set -e
  [ "$rc" = 0 ] || echo "bootstrap.sh: pip $1 failed (exit $rc; its output above says why; $(df -Ph . | awk 'NR==2 {print $4}') free here, and a fresh .venv takes about 13 GB)" >&2
  return "$rc"
}

if [ "$GPU" = 0 ]; then  # the CPU machine (the README's two commands, CI)
  stamp=".venv/.specforge-kimi-installed"
  want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && .venv/bin/python -c 'import specforge_kimi, specforge' 2>/dev/null; then
    exit 0
  fi
  [ -x .venv/bin/python ] || "$PY" -m venv .venv
  pip_run .venv/bin/python install -q --upgrade pip
  echo "installing the pinned stack into .venv (several GB on a fresh machine, a few minutes) ..."
  pip_run .venv/bin/python install -q -e '.[test,cpu]'
  .venv/bin/python -c 'import specforge_kimi, specforge, sglang, torch, transformers; print("stack:", "torch", torch.__version__, "transformers", transformers.__version__)'
  echo "$want" > "$stamp"
  exit 0
fi

# ---- GPU host ----------------------------------------------------------------------------------
die() { echo "bootstrap.sh --gpu: $*" >&2; exit 2; }
SF_COMMIT="${SPECFORGE_COMMIT:-a6b6b023}"  # = setup_patches.SPECFORGE_PIN_COMMIT (what `setup` accepts)
SF_REPO="${SPECFORGE_REPO:-https://github.com/sgl-project/SpecForge}"
if [ "$INSTALL" = 1 ]; then
  VPY="$VENV/bin/python"
  [ -x "$VPY" ] || "$PY" -m venv "$VENV"
  pip_q() { pip_run "$VPY" "$@"; }
  pip_q install -q --upgrade pip
  if [ -n "$TORCH_INDEX" ]; then
    echo "installing torch 2.11.0 from $TORCH_INDEX ..."
    pip_q install -q 'torch==2.11.0' --index-url "$TORCH_INDEX"
  fi
  echo "installing the pinned stack into $VENV (several GB on a fresh machine, a few minutes) ..."
  pip_q install -q -e '.[test]'
else
  VPY="$PY"
  [ "$VENV" = .venv ] || VPY="$VENV/bin/python"
fi
if [ -z "$CUDA_MAJOR" ]; then
  CUDA_MAJOR="$("$VPY" -c 'import torch; print((torch.version.cuda or "").split(".")[0])' 2>/dev/null)" \
    || die "cannot import torch from $VPY"
fi
case "$CUDA_MAJOR" in
  13) EXTRA=gpu DIST=mooncake-transfer-engine-cuda13;;
  12) EXTRA=gpu-cu12 DIST=mooncake-transfer-engine;;
  "") die "the torch in $VPY is a CPU build: install a CUDA one (--torch-index https://download.pytorch.org/whl/cu130), or pass --cuda 12|13";;
  *) die "torch is built for CUDA $CUDA_MAJOR; Mooncake ships builds for CUDA 12 and 13 only (--cuda 12|13 to choose one)";;
esac
if [ "$INSTALL" = 1 ]; then
  REINSTALL=0
  for other in mooncake-transfer-engine-non-cuda mooncake-transfer-engine mooncake-transfer-engine-cuda13; do
    if [ "$other" != "$DIST" ] && "$VPY" -m pip show -q "$other" >/dev/null 2>&1; then
      echo "removing $other (Mooncake's builds share one package; CUDA $CUDA_MAJOR needs $DIST)"
      pip_q uninstall -y -q "$other"
      REINSTALL=1
    fi
  done
  echo "installing Mooncake's CUDA $CUDA_MAJOR build (extra $EXTRA) ..."
  pip_q install -q -e ".[test,$EXTRA]"
  if [ "$REINSTALL" = 1 ]; then  # the removed build deleted files of the shared package
    pin="$("$VPY" -c 'import sys, tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"][sys.argv[1]][0])' "$EXTRA")"
    pip_q install -q --force-reinstall --no-deps "$pin"
  fi
fi

# SpecForge's source at the pinned commit: its SGLang capture patch ships only there
if [ -z "$SF_CHECKOUT" ]; then
  SF_CHECKOUT="$SF_DIR"
  if [ -d "$SF_CHECKOUT/.git" ]; then
    git -C "$SF_CHECKOUT" checkout -q "$SF_COMMIT" 2>/dev/null \
      || die "$SF_CHECKOUT has no commit $SF_COMMIT; remove it (it is re-cloned) or pass --specforge-checkout DIR"
  else
    echo "fetching SpecForge at $SF_COMMIT from $SF_REPO into $SF_CHECKOUT ..."
    mkdir -p "$(dirname "$SF_CHECKOUT")"
    rm -rf "$SF_CHECKOUT.partial"
    git clone -q "$SF_REPO" "$SF_CHECKOUT.partial" 2>/dev/null || {
      rm -rf "$SF_CHECKOUT.partial"
      die "could not clone $SF_REPO (no network?): fetch SpecForge at commit $SF_COMMIT elsewhere, copy it here and pass --specforge-checkout DIR"
    }
    git -C "$SF_CHECKOUT.partial" checkout -q "$SF_COMMIT" 2>/dev/null || {
      rm -rf "$SF_CHECKOUT.partial"
      die "$SF_REPO has no commit $SF_COMMIT"
    }
    mv "$SF_CHECKOUT.partial" "$SF_CHECKOUT"
  fi
fi
[ -d "$SF_CHECKOUT" ] || die "--specforge-checkout $SF_CHECKOUT is not a directory"
echo "patching: SpecForge's SGLang capture patch and ours into the installed sglang (from $SF_CHECKOUT) ..."
"$VPY" -m specforge_kimi setup --specforge-checkout "$SF_CHECKOUT"
echo "patching: our SpecForge patches into the installed specforge ..."
"$VPY" -m specforge_kimi setup --no-sglang
echo "checking this machine (specforge-kimi doctor) ..."
rc=0
"$VPY" -m specforge_kimi doctor || rc=$?
[ "$rc" = 0 ] && echo "ready: next, specforge-kimi doctor RECIPE checks your recipe's target and GPUs (README, 'Your first Kimi-K2.5 run')"
exit "$rc"
