#!/usr/bin/env bash
# Builds containerd 2 and its runc shim (for CDI, which Debian 12's containerd 1.6 lacks)
# from their Go module, pinned in hack/tools/containerd, and caches them under
# ~/.cache/kvhandoff/containerd/<version>/. Prints that folder on stdout.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
mod=$here/tools/containerd
version=$(awk '$1=="github.com/containerd/containerd/v2" {print $2} $1=="require" && $2=="github.com/containerd/containerd/v2" {print $3}' "$mod/go.mod")
cache=${KVHANDOFF_CACHE:-$HOME/.cache/kvhandoff}/containerd/$version
if [ ! -x "$cache/containerd-shim-runc-v2" ]; then
  echo "building containerd $version into $cache" >&2
  start=$SECONDS
  mkdir -p "$cache"
  (cd "$mod" && CGO_ENABLED=0 "$here/retry.sh" go build -trimpath -ldflags "-s -w" -tags no_btrfs,no_devmapper,no_zfs,no_aufs -o "$cache/" \
    github.com/containerd/containerd/v2/cmd/containerd github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2)
  echo "built containerd in $((SECONDS - start))s" >&2
fi
echo "$cache"
