#!/usr/bin/env bash
# Build FlashInfer 0.7.2.post1's top-k module (what SGLang's QSA top-k calls) for sm_90a on a CPU
# machine with nvcc 13, for `stage_wheels.sh` to carry: the H200 machine would compile it on first
# use (~13 minutes there). On this image's 2 cores: cub_topk.cu ~22 minutes, the rest ~6 alongside.
#
#   bash benchmarks/device/build_topk.sh [WORKDIR]     (default /tmp/bench-topk; output WORKDIR/topk.so)
#
# The recipe of ../shared/peers/flashinfer_topk_sm90/build.sh (FlashInfer's own flags) with what it
# lacks here (session 17): topk.cu includes curand_kernel.h, which /usr/local/cuda does not have
# (the nvidia-curand cu13 wheel does); there is no libcuda stub to link and none is needed
# (-lcudart only); a failing compile stops the build instead of leaving an undefined symbol.
set -euo pipefail
W=$(mkdir -p "${1:-/tmp/bench-topk}" && cd "${1:-/tmp/bench-topk}" && pwd)
CU=${CUDA_HOME:-/usr/local/cuda}
cd "$W"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$W/wheels" \
  flashinfer-python==0.7.2.post1 apache-tvm-ffi==0.1.12 nvidia-curand==10.4.4.72
for w in "$W"/wheels/*.whl; do python3 -m zipfile -e "$w" "$W/src"; done
F=$W/src/flashinfer/data
T=$W/src/tvm_ffi
CURAND=$(dirname "$(find "$W/src/nvidia" -name curand_kernel.h | head -1)")
INC="-isystem $CURAND -I$F/cccl/cub -I$F/cccl/libcudacxx/include -I$F/cccl/thrust -isystem $CU/include
  -isystem $T/include -isystem $T/3rdparty/dlpack/include -isystem $F/include -isystem $F/csrc
  -isystem $F/cutlass/include -isystem $F/cutlass/tools/util/include -isystem $F/spdlog/include"
FLAGS="-DPy_LIMITED_API=0x03090000 -D_GLIBCXX_USE_CXX11_ABI=1 --compiler-options=-fPIC --expt-relaxed-constexpr
  -static-global-template-stub=false -gencode=arch=compute_90a,code=sm_90a -DFLASHINFER_ENABLE_FP8_E8M0
  -DFLASHINFER_ENABLE_FP4_E2M1 -std=c++17 --threads=1 -use_fast_math -Xfatbin=-compress-all --compress-mode=size
  -DFLASHINFER_ENABLE_F16 -DFLASHINFER_ENABLE_BF16 -DFLASHINFER_ENABLE_FP8_E4M3 -DFLASHINFER_ENABLE_FP8_E5M2
  -DNDEBUG -O3"
mkdir -p "$W/obj"
pids=()
for s in cub_topk topk flashinfer_topk_binding flashinfer_fast_topk_clusters_binding; do  # the longest first
  # shellcheck disable=SC2086
  "$CU/bin/nvcc" $INC $FLAGS -c "$F/csrc/$s.cu" -o "$W/obj/$s.o" &
  pids+=($!)
  while [ "$(jobs -r | wc -l)" -ge 2 ]; do sleep 5; done
done
for p in "${pids[@]}"; do wait "$p"; done  # set -e: a failed compile ends the build here
c++ "$W"/obj/*.o -shared -L"$CU/lib64" -lcudart -o "$W/topk.so"
if nm -D --undefined-only "$W/topk.so" | grep -q topk; then
  echo "$W/topk.so: undefined top-k symbols" >&2; exit 1
fi
ls -la "$W/topk.so"
