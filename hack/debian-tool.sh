#!/usr/bin/env bash
# Unpacks a program from Debian's archive once into ~/.cache/kvhandoff/debian/<package>-<version>
# and prints its path: the package's files only (dpkg -x), none of its install scripts, so
# nothing is installed system-wide and no service starts (Debian's prometheus package
# would start a server on :9090).
#
#   hack/debian-tool.sh PACKAGE PATH_IN_PACKAGE    e.g. prometheus usr/bin/promtool
set -euo pipefail
pkg=$1 path=$2
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
version() { apt-cache show --no-all-versions "$pkg" 2>/dev/null | awk '$1=="Version:" {print $2; exit}'; }
v=$(version)
if [ -z "$v" ]; then
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo=sudo
  $sudo "$here/retry.sh" apt-get update -qq >&2
  v=$(version)
fi
[ -n "$v" ] || { echo "debian-tool: Debian's archive has no package $pkg" >&2; exit 1; }
dir=${KVHANDOFF_CACHE:-$HOME/.cache/kvhandoff}/debian/$pkg-${v//[:~]/_}
if [ ! -x "$dir/$path" ]; then
  echo "unpacking Debian's $pkg $v into $dir — first time only" >&2
  tmp=$(mktemp -d)
  chmod 0777 "$tmp" # apt-get download fetches as its _apt user
  trap 'rm -rf "$tmp"' EXIT
  (cd "$tmp" && "$here/retry.sh" apt-get download -qq "$pkg=$v" >&2)
  rm -rf "$dir.tmp" && mkdir -p "$dir.tmp"
  dpkg -x "$tmp"/*.deb "$dir.tmp"
  rm -rf "$dir" && mv "$dir.tmp" "$dir"
fi
echo "$dir/$path"
