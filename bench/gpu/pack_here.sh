#!/usr/bin/env bash
# The CUDA build the device machine's bench runs (bench/gpu/session.sh), compiled HERE, on a machine without a GPU,
# and packed as .device/cudabin/: a lent GPU then spends its minutes measuring, not compiling (~350 s of a 30 min
# budget; on 2 cores here it takes about 25 min, in the background).
#   bash bench/gpu/pack_here.sh          # -> .device/cudabin/build-cuda-KEY.tar.xz.0 ... (15 MiB parts)
# session.sh's unpack takes it when KEY (cmake flags + patch set) is the tree's, checks that it runs there
# (llama-server --list-devices shows CUDA0) and that the CPU has every instruction-set flag of this machine
# (GGML_NATIVE=ON builds ggml-cpu for the build host), else compiles as before.
# The toolkit: NVIDIA's CUDA 13.0 wheels from PyPI (the device has CUDA 13.0, driver 580): nvcc, the runtime and
# cuBLAS headers and libraries, CCCL. Linking needs libcuda.so, which only a driver installs: a stub with every
# cu* entry point of cuda.h stands in, and the binaries load the device's own libcuda.so.1.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
PY=${PY:-$ROOT/.venv/bin/python}
T=${PACK_DIR:-/tmp/arcsplit-cudapack}
CU=$T/toolkit/nvidia/cu13
mkdir -p "$T" .device/cudabin
if [ ! -x "$CU/bin/nvcc" ]; then
  "$PY" -m pip install -q --target "$T/toolkit" nvidia-cuda-nvcc==13.0.88 nvidia-cuda-runtime==13.0.96 \
    nvidia-cublas==13.0.2.14 nvidia-cuda-cccl==13.0.85 nvidia-cuda-crt==13.0.88 nvidia-nvvm==13.0.88
fi
# nvcc's profile looks for lib64; CMake's FindCUDAToolkit for the unversioned names and for lib64/stubs/libcuda.so
ln -sfn lib "$CU/lib64"
for l in cudart cublas cublasLt; do ln -sf "lib$l.so.13" "$CU/lib/lib$l.so"; done
mkdir -p "$CU/lib/stubs"
if [ ! -f "$CU/lib/stubs/libcuda.so" ]; then
  echo '#include <cuda.h>' | gcc -E -I"$CU/include" -x c - | "$PY" -c "
import re, sys
names = sorted(set(re.findall(r'\bCUresult\s+(cu[A-Za-z0-9_]+)\s*\(', sys.stdin.read())))
print(''.join(f'void {n}(void){{}}\n' for n in names), end='')" > "$T/libcuda_stub.c"
  gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$CU/lib/stubs/libcuda.so" "$T/libcuda_stub.c"
fi
ln -sf libcuda.so "$CU/lib/stubs/libcuda.so.1"  # what the linker looks for behind libggml-cuda.so's NEEDED
# the same tree the device builds: the pinned source as .device/llama-src.tar.gz holds it (session.sh's header)
[ -d "$T/src" ] || tar xzf .device/llama-src.tar.gz -C "$T"
export ARCSPLIT_CACHE_DIR=$T/cache CUDACXX=$CU/bin/nvcc CUDAToolkit_ROOT=$CU PATH=$CU/bin:$PATH
export LD_LIBRARY_PATH=$CU/lib/stubs:$CU/lib  # for the link only: the binaries' RUNPATH stays $ORIGIN
FLAG=-DCMAKE_CUDA_ARCHITECTURES=90  # session.sh's CUDA_FLAG: the key must be the one the device computes
nice -n 5 "$PY" -m arcsplit llama build --backend cuda --source "$T/src" --cmake-flag=$FLAG --no-ui
DIR=$("$PY" -c "from arcsplit.llama.build import BuildConfig; print(BuildConfig('cuda', ('$FLAG',)).build_dir)")
grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2 > "$DIR/bin/.build-host-cpu-flags"
NAME=$(basename "$DIR")
rm -f .device/cudabin/"$NAME".tar.xz.*
tar cf - -C "$(dirname "$DIR")" "$NAME/bin" | xz -T0 -6 | split -b 15M -d -a 1 - ".device/cudabin/$NAME.tar.xz."
ls -l .device/cudabin/"$NAME".tar.xz.*
