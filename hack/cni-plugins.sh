#!/usr/bin/env bash
# Builds the CNI plugins the real-node tier needs (bridge, host-local, loopback, portmap)
# from their Go module, pinned in hack/tools/cni, and caches them under
# ~/.cache/kvhandoff/cni/<version>/. Prints that folder on stdout.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
mod=$here/tools/cni
version=$(awk '$1=="github.com/containernetworking/plugins" {print $2} $1=="require" && $2=="github.com/containernetworking/plugins" {print $3}' "$mod/go.mod")
cache=${KVHANDOFF_CACHE:-$HOME/.cache/kvhandoff}/cni/$version
plugins=(main/bridge ipam/host-local main/loopback meta/portmap)
if [ ! -x "$cache/portmap" ]; then
  echo "building the CNI plugins $version into $cache" >&2
  start=$SECONDS
  mkdir -p "$cache"
  (cd "$mod" && CGO_ENABLED=0 "$here/retry.sh" go build -trimpath -ldflags "-s -w" -o "$cache/" \
    "${plugins[@]/#/github.com/containernetworking/plugins/plugins/}")
  echo "built the CNI plugins in $((SECONDS - start))s" >&2
fi
echo "$cache"
