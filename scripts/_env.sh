# Sourced by the scripts: make .venv with arcsplit, once per pyproject change.
# ARCSPLIT_SETUP=serve (scripts/demo): arcsplit and what serving needs, nothing else.
# ARCSPLIT_SETUP=all (the default: scripts/test, CI): also the test extras, the llama-cpp-python bindings and,
# as root with apt, the system tools some tests use. Each profile has its own stamp in .venv; a venv set up for
# all also serves the demo, and a lean one is completed by the next test run.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
SETUP="${ARCSPLIT_SETUP:-all}"
# setuptools prints an "Editable installation ... folders named like your package" banner on every `pip install -e`
# (a BuildBackendWarning, even with --quiet); it is about Python's import path, not about this install: keep it out.
EDITABLE_QUIET="ignore:Editable installation"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
hash="$(cat pyproject.toml scripts/_env.sh | sha256sum | cut -c1-16)"
if [ "$SETUP" = serve ]; then
  if [ ! -f ".venv/.arcsplit-all-$hash" ] && [ ! -f ".venv/.arcsplit-serve-$hash" ]; then
    echo "arcsplit: installing into .venv (what serving needs) …" >&2
    .venv/bin/python -m pip install --quiet --upgrade pip >/dev/null
    PYTHONWARNINGS="$EDITABLE_QUIET" .venv/bin/python -m pip install --quiet -e .
    rm -f .venv/.arcsplit-serve-* && touch ".venv/.arcsplit-serve-$hash"
  fi
  export PATH="$ROOT/.venv/bin:$PATH"
  return 0
fi
stamp=".venv/.arcsplit-all-$hash"
if [ ! -f "$stamp" ]; then
  echo "arcsplit: installing into .venv (everything the tests use) …" >&2
  .venv/bin/python -m pip install --quiet --upgrade pip >/dev/null
  PYTHONWARNINGS="$EDITABLE_QUIET" .venv/bin/python -m pip install --quiet -e ".[test,bench]"
  # arcsplit.load's bindings, built against arcsplit's own libllama (nothing of llama.cpp is compiled here).
  CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" .venv/bin/python -m pip install --quiet \
    --no-binary llama-cpp-python "llama-cpp-python==0.3.36"
  rm -f .venv/.arcsplit-* && touch "$stamp"
fi
# Optional, installed when we may: ccache makes a rebuilt llama.cpp take seconds; chromium and its driver run
# tests/test_webui.py; OpenSSH's server runs inside the network namespaces of tests/_netns.py (several hosts:
# tests/test_netns.py, tests/test_multihost.py; only started by those tests, on a throwaway config). Each is skipped
# with its reason when absent.
want=""
command -v ccache >/dev/null 2>&1 || want="$want ccache"
command -v chromedriver >/dev/null 2>&1 || want="$want chromium chromium-driver"
[ -x /usr/sbin/sshd ] || want="$want openssh-server openssh-client"
if [ -n "$want" ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  # shellcheck disable=SC2086
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $want) >/dev/null 2>&1 || true
  # A system sshd is not what the tests asked for: where systemd started the one we just installed, stop it.
  case "$want" in *openssh-server*) [ -d /run/systemd/system ] && \
    systemctl disable --now ssh.service ssh.socket >/dev/null 2>&1 || true ;; esac
fi
export PATH="$ROOT/.venv/bin:$PATH"
