# Sourced by the scripts: make .venv with arcsplit and its test extras, once per pyproject change.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=".venv/.arcsplit-$(cat pyproject.toml scripts/_env.sh | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  echo "arcsplit: installing into .venv …" >&2
  .venv/bin/python -m pip install --quiet --upgrade pip >/dev/null
  .venv/bin/python -m pip install --quiet -e ".[test]"
  # arcsplit.load's bindings, built against arcsplit's own libllama (nothing of llama.cpp is compiled here).
  CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" .venv/bin/python -m pip install --quiet \
    --no-binary llama-cpp-python "llama-cpp-python==0.3.36"
  rm -f .venv/.arcsplit-* && touch "$stamp"
fi
# Optional, installed when we may: ccache makes a rebuilt llama.cpp take seconds; chromium and its driver run
# tests/test_webui.py (skipped without them).
want=""
command -v ccache >/dev/null 2>&1 || want="$want ccache"
command -v chromedriver >/dev/null 2>&1 || want="$want chromium chromium-driver"
if [ -n "$want" ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  # shellcheck disable=SC2086
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $want) >/dev/null 2>&1 || true
fi
export PATH="$ROOT/.venv/bin:$PATH"
