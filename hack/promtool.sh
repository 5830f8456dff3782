#!/usr/bin/env bash
# Builds promtool from Prometheus's Go module (pinned in hack/tools/prometheus) into
# ~/.cache/kvhandoff/tools/promtool-<version> once, and prints its path.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
mod=$here/tools/prometheus
version=$(awk '$1=="github.com/prometheus/prometheus" {print $2}' "$mod/go.mod")
bin=${KVHANDOFF_CACHE:-$HOME/.cache/kvhandoff}/tools/promtool-$version
if [ ! -x "$bin" ]; then
  echo "building promtool $version into $bin — first time only" >&2
  start=$SECONDS
  mkdir -p "$(dirname "$bin")"
  (cd "$mod" && CGO_ENABLED=0 go build -trimpath -ldflags "-s -w" -o "$bin.tmp" github.com/prometheus/prometheus/cmd/promtool)
  mv "$bin.tmp" "$bin"
  echo "built promtool in $((SECONDS - start))s" >&2
fi
echo "$bin"
