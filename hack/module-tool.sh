#!/usr/bin/env bash
# Builds a tool from its Go module, pinned in a helper module under hack/tools, into
# ~/.cache/kvhandoff/tools/<name>-<version> once, and prints its path.
#
#   hack/module-tool.sh HELPER NAME MODULE PACKAGE [LDFLAGS [TAGS]]   (VERSION in LDFLAGS is the module's version)
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
helper=$here/tools/$1
name=$2 module=$3 package=$4 ldflags=${5:-} tags=${6:-}
version=$(awk -v m="$module" '$1==m {print $2} $1=="require" && $2==m {print $3}' "$helper/go.mod")
bin=${KVHANDOFF_CACHE:-$HOME/.cache/kvhandoff}/tools/$name-$version
if [ ! -x "$bin" ]; then
  echo "building $name $version into $bin — first time only" >&2
  start=$SECONDS
  mkdir -p "$(dirname "$bin")"
  (cd "$helper" && CGO_ENABLED=0 "$here/retry.sh" go build -trimpath -tags "$tags" -ldflags "-s -w ${ldflags//VERSION/$version}" -o "$bin.tmp" "$package")
  mv "$bin.tmp" "$bin"
  echo "built $name in $((SECONDS - start))s" >&2
fi
echo "$bin"
