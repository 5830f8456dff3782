#!/usr/bin/env bash
# Installs a Go program at a pinned version into ~/.cache/kvhandoff/tools/NAME-VERSION (once)
# and links it to DEST, so fresh clones reuse the cached build.
#
#   hack/go-install.sh NAME PACKAGE VERSION DEST
set -euo pipefail
name=$1 pkg=$2 version=$3 dest=$4
tools=${KVHANDOFF_CACHE:-$HOME/.cache/kvhandoff}/tools
bin=$tools/$name-$version
if [ ! -x "$bin" ]; then
  echo "building $name $version into $tools" >&2
  tmp=$(mktemp -d "$tools.XXXXXX" 2>/dev/null || { mkdir -p "$tools" && mktemp -d "$tools/.tmp.XXXXXX"; })
  GOBIN=$tmp "$(dirname "${BASH_SOURCE[0]}")/retry.sh" go install "$pkg@$version"
  mkdir -p "$tools" && mv "$tmp/$(basename "$pkg")" "$bin" && rm -rf "$tmp"
fi
mkdir -p "$(dirname "$dest")"
ln -sf "$bin" "$dest"
