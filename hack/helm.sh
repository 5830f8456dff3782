#!/usr/bin/env bash
# Builds helm from its Go module (pinned in hack/tools/helm) into
# ~/.cache/kvhandoff/tools/helm-<version> once, and prints its path.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
mod=$here/tools/helm
version=$(awk '$1=="helm.sh/helm/v3" {print $2} $1=="require" && $2=="helm.sh/helm/v3" {print $3}' "$mod/go.mod")
bin=${KVHANDOFF_CACHE:-$HOME/.cache/kvhandoff}/tools/helm-$version
if [ ! -x "$bin" ]; then
  echo "building helm $version into $bin — first time only" >&2
  start=$SECONDS
  mkdir -p "$(dirname "$bin")"
  (cd "$mod" && CGO_ENABLED=0 go build -trimpath -ldflags "-s -w -X helm.sh/helm/v3/internal/version.version=$version" -o "$bin.tmp" helm.sh/helm/v3/cmd/helm)
  mv "$bin.tmp" "$bin"
  echo "built helm in $((SECONDS - start))s" >&2
fi
echo "$bin"
