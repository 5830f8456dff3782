#!/usr/bin/env bash
# The GPU tier's real vLLM, for a GPU host with no network: vLLM 0.26.0 (the newest release
# that loads against PyTorch 2.11, which such hosts carry), the Python packages it imports
# that the host lacks, stock NIXL (the bench's NixlConnector and NixlPushConnector engines),
# and kvhandoff's agent and router.
#
#   hack/gpu-vllm.sh pack OUT        here, with network: writes OUT/part-00, part-01, ...
#                                    (each at most 58 MiB: one device call carries one)
#   hack/gpu-vllm.sh install PARTS   on the GPU host: assembles PARTS/part-* into $KVH_GPU_DIR
#                                    (default /tmp/kvh-gpu): site/ for PYTHONPATH, bin/ for
#                                    KVHANDOFF_BIN_DIR
#
# vLLM's wheel is 290 MiB; the set leaves out what an H200 running a dense model never
# loads: the FlashAttention 2 library (Hopper runs FlashAttention 3), the optional Rust
# frontend, the MoE kernels (imported only if present), the SM100 attention sources and
# DeepGEMM's builds for other Pythons. NIXL's CUDA 13 build (a 56 MiB wheel) goes without its
# C headers (.data/headers), which only building against it needs. Downloads are cached under
# $KVHANDOFF_CACHE/gpu-vllm (default ~/.cache/kvhandoff).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
VLLM=0.26.0
NIXL=1.5.1
TRIM=(vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so vllm/vllm-rs vllm/_moe_C_stable_libtorch.abi3.so vllm/third_party/fmha_sm100
  vllm/third_party/deep_gemm/_C.cpython-310-x86_64-linux-gnu.so vllm/third_party/deep_gemm/_C.cpython-311-x86_64-linux-gnu.so
  vllm/third_party/deep_gemm/_C.cpython-313-x86_64-linux-gnu.so vllm/third_party/deep_gemm/_C.cpython-314-x86_64-linux-gnu.so)

cp312() {
  "$root/hack/retry.sh" python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 --platform any "$@"
}

pack() {
  local out=$1 cache=${KVHANDOFF_CACHE:-$HOME/.cache/kvhandoff}/gpu-vllm
  mkdir -p "$cache/wheels" "$out"
  local trimmed=$cache/vllm-$VLLM-trimmed.tar.xz
  if [ ! -e "$trimmed" ]; then
    cp312 -d "$cache" "vllm==$VLLM"
    local tree
    tree=$(mktemp -d)
    python3 -m zipfile -e "$cache/vllm-$VLLM-cp38-abi3-manylinux_2_28_x86_64.whl" "$tree"
    for f in "${TRIM[@]}"; do
      [ -e "$tree/$f" ] || { echo "gpu-vllm: $f is not in vLLM $VLLM's wheel" >&2; exit 1; }
      rm -rf "${tree:?}/$f"
    done
    tar -C "$tree" -cf - . | xz -T0 -6 >"$trimmed.part"
    mv "$trimmed.part" "$trimmed"
    rm -rf "$tree"
  fi
  local nixl=$cache/nixl-$NIXL-trimmed.tar.xz
  if [ ! -e "$nixl" ]; then
    cp312 -d "$cache" "nixl==$NIXL" "nixl-cu13==$NIXL"
    local tree
    tree=$(mktemp -d)
    for w in "$cache/nixl-$NIXL-py3-none-any.whl" "$cache/nixl_cu13-$NIXL-cp312-cp312-manylinux_2_28_x86_64.whl"; do
      python3 -m zipfile -e "$w" "$tree"
    done
    rm -rf "$tree/nixl_cu13-$NIXL.data"
    tar -C "$tree" -cf - . | xz -T0 -6 >"$nixl.part"
    mv "$nixl.part" "$nixl"
    rm -rf "$tree"
  fi
  cp312 -d "$cache/wheels" -r "$root/vllm-connector/gpu_tests/requirements-gpu-vllm.txt"
  local stage
  stage=$(mktemp -d)
  mkdir -p "$stage/wheels" "$stage/bin" "$stage/lib"
  cp "$trimmed" "$stage/vllm.tar.xz"
  cp "$nixl" "$stage/nixl.tar.xz"
  # Exactly the pinned wheels, however many the cache holds (names compared as pip does).
  python3 - "$root/vllm-connector/gpu_tests/requirements-gpu-vllm.txt" "$cache/wheels" "$stage/wheels" <<'PY'
import os, re, shutil, sys
norm = lambda n: re.sub(r"[-_.]+", "_", n).lower()
have = {(norm(f.split("-")[0]), f.split("-")[1]): f for f in os.listdir(sys.argv[2]) if f.endswith(".whl")}
for line in open(sys.argv[1]):
    if line.strip() and not line.startswith("#"):
        name, version = line.strip().split("==")
        shutil.copy(os.path.join(sys.argv[2], have[(norm(name), version)]), sys.argv[3])
PY
  (cd "$root" && CGO_CFLAGS="-O2 -Wno-deprecated-declarations" go build -ldflags="-s -w" -o "$stage/bin/" ./cmd/transfer-agent ./cmd/router ./cmd/kv-events)
  # The agent's libfabric and what it links, from this machine (the GPU host has none).
  for lib in $(ldd "$stage/bin/transfer-agent" | awk '$3 ~ /^\// {print $3}' | grep -v -e '/libc\.so' -e '/ld-linux'); do
    cp -L "$lib" "$stage/lib/"
  done
  tar -C "$stage" -cf - bin lib | xz -T0 -6 >"$stage/bin.tar.xz"
  rm -rf "$stage/bin" "$stage/lib"
  rm -f "$out"/part-*
  tar -C "$stage" -cf - . | split -b 58M -d - "$out/part-"
  rm -rf "$stage"
  ls -l "$out"
}

install() {
  local parts=$1 dir=${KVH_GPU_DIR:-/tmp/kvh-gpu}
  rm -rf "$dir" && mkdir -p "$dir/stage" "$dir/site" "$dir/bin"
  cat "$parts"/part-* | tar -C "$dir/stage" -xf -
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$dir/site" "$dir/stage/wheels/"*.whl
  tar -C "$dir/site" -xJf "$dir/stage/vllm.tar.xz"
  tar -C "$dir/site" -xJf "$dir/stage/nixl.tar.xz"
  tar -C "$dir/stage" -xJf "$dir/stage/bin.tar.xz"
  mv "$dir/stage/lib" "$dir/lib"
  for b in transfer-agent router; do
    mv "$dir/stage/bin/$b" "$dir/bin/$b.bin"
    printf '#!/bin/sh\nLD_LIBRARY_PATH=%s/lib exec %s/bin/%s.bin "$@"\n' "$dir" "$dir" "$b" >"$dir/bin/$b"
    chmod +x "$dir/bin/$b"
  done
  rm -rf "$dir/stage"
  echo "gpu-vllm: installed in $dir (PYTHONPATH=$dir/site KVHANDOFF_BIN_DIR=$dir/bin)"
}

case ${1:-} in
pack) pack "${2:?OUT}" ;;
install) install "${2:?PARTS}" ;;
*) echo "usage: $0 pack OUT | install PARTS" >&2; exit 2 ;;
esac
