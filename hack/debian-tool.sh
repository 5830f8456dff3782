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
# awk reads all of apt-cache's output: quitting at the first match would end apt-cache by
# SIGPIPE, which pipefail makes this script's exit (141).
version() { apt-cache show --no-all-versions "$pkg" 2>/dev/null | awk '$1=="Version:" && !v {v=$2} END {print v}'; }
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
  # Unpacked beside, then renamed: two callers at once (promtool and the server, from two
  # test packages) each unpack their own copy, and the first rename wins.
  mkdir -p "$(dirname "$dir")"
  part=$(mktemp -d "$dir.part.XXXXXX")
  dpkg -x "$tmp"/*.deb "$part"
  mv -T "$part" "$dir" 2>/dev/null || rm -rf "$part"
fi
echo "$dir/$path"
