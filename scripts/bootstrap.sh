#!/usr/bin/env bash
# Set up .venv with the pinned stack (specforge==0.2.0 -> torch 2.11.0, transformers 5.8.1,
# sglang 0.5.14) and specforge-kimi installed editable. Idempotent: a venv whose install stamp
# matches pyproject.toml is reused. Python 3.11 or 3.12 (python3 on PATH, or $PYTHON).
set -euo pipefail
cd "$(dirname "$0")/.."
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
stamp=".venv/.specforge-kimi-installed"
want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && .venv/bin/python -c 'import specforge_kimi, specforge' 2>/dev/null; then
  exit 0
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v '^WARNING: Location' || true
echo "installing the pinned stack into .venv (several GB on a fresh machine, a few minutes) ..."
.venv/bin/python -m pip install -q -e '.[test,cpu]' 2>&1 | grep -v '^WARNING: Location' || true
.venv/bin/python -c 'import specforge_kimi, specforge, sglang, torch, transformers; print("stack:", "torch", torch.__version__, "transformers", transformers.__version__)'
echo "$want" > "$stamp"
