#!/usr/bin/env bash
# Installs stock NIXL from PyPI once into ~/.cache/kvhandoff/nixl-<version>, for make
# bench-vllm's NixlConnector and NixlPushConnector engines, and prints the folder for
# PYTHONPATH: the nixl meta package and its CUDA 13 build (the one it picks beside the
# real-vLLM tier's torch), which bundles UCX and imports without a GPU. 1.5.1: the index
# had no nixl-cu13 1.5.2 for the 1.5.2 meta package.
set -euo pipefail
version=1.5.1
dir=${KVHANDOFF_CACHE:-$HOME/.cache/kvhandoff}/nixl-$version
if [ ! -d "$dir/nixl" ]; then
  echo "installing nixl $version into $dir — first time only" >&2
  "$(dirname "$0")/retry.sh" python3 -m pip install --quiet --root-user-action=ignore --no-deps --target "$dir.tmp" "nixl==$version" "nixl-cu13==$version" >&2
  rm -rf "$dir" && mv "$dir.tmp" "$dir"
fi
echo "$dir"
