# Sourced after _env.sh: Intel's SYCL runtime and OpenCL CPU runtime from PyPI, in a venv of their own in the
# user cache (about 1.5 GB, 40-60 s to install once; not in .venv), for tests/test_sycl_runtime.py. They give
# a real `opencl:cpu` SYCL device and the real ONEAPI_DEVICE_SELECTOR parser; llama.cpp's SYCL backend itself
# cannot be built (no icpx on PyPI or Debian) nor run (it refuses a platform without a GPU) here.
# Best effort: when the install fails the tests that need it skip and say why.
ONEAPI_RT_VERSION=2026.2.0
_oneapi_cache="${ARCSPLIT_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/arcsplit}"
_oneapi_rt="$_oneapi_cache/oneapi-rt/$ONEAPI_RT_VERSION"
if [ ! -f "$_oneapi_rt/.complete" ]; then
  # arcsplit's cache lock (arcsplit/_dirs.py cache_lock), then "is it done?" again: another run may have installed it.
  mkdir -p "$_oneapi_cache"
  exec 9>>"$_oneapi_cache/lock"
  flock -n 9 || { echo "arcsplit: waiting for another arcsplit process writing the cache …" >&2; flock 9; }
fi
if [ ! -f "$_oneapi_rt/.complete" ]; then
  echo "arcsplit: installing Intel's SYCL + OpenCL CPU runtime $ONEAPI_RT_VERSION into $_oneapi_rt …" >&2
  rm -rf "$_oneapi_rt"
  if "$PY" -m venv "$_oneapi_rt" && "$_oneapi_rt/bin/python" -m pip install --quiet --disable-pip-version-check \
       "intel-sycl-rt==$ONEAPI_RT_VERSION" "intel-opencl-rt==$ONEAPI_RT_VERSION" "dpctl==0.22.1" >/dev/null; then
    touch "$_oneapi_rt/.complete"
  else
    echo "arcsplit: the oneAPI runtime did not install; tests/test_sycl_runtime.py will skip" >&2
    rm -rf "$_oneapi_rt"
  fi
fi
{ flock -u 9 && exec 9>&-; } 2>/dev/null || true  # never held by the tests this script then runs
[ -f "$_oneapi_rt/.complete" ] && export ARCSPLIT_TEST_ONEAPI_RT="$_oneapi_rt"
true
