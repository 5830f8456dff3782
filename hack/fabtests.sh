#!/usr/bin/env bash
# Builds (once) and prints a scratch install of libfabric and its fabtests under
# ~/.cache/kvhandoff/fabtests, for the handoff benchmark's fi_rma_bw comparison. Nothing
# of it is committed. The source is Debian's libfabric 2.1.0 orig tarball: the archive
# here does not serve the source of the installed 1.17 (its orig tarball answers 404), so
# the benchmark runs fi_rma_bw *and* the agent on this build, like with like, and the
# agent on the installed library beside them for context.
#
#   hack/fabtests.sh   → prints the install prefix (bin/fi_rma_bw, lib/libfabric.so.1)
set -euo pipefail
version=2.1.0
sha256=1a66369772d5bb151737214af1c478993e969cf298e8f9ed369e7a2ab8d8c6df
cache=${KVHANDOFF_CACHE:-$HOME/.cache/kvhandoff}
prefix=$cache/fabtests/$version
if [ -e "$prefix/.complete" ]; then
  echo "$prefix"
  exit 0
fi
missing=()
for tool in autoconf automake libtoolize; do
  command -v "$tool" >/dev/null || missing+=("${tool/libtoolize/libtool}")
done
"$(dirname "$0")/apt-install.sh" ${missing[@]+"${missing[@]}"}
start=$(date +%s)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "building libfabric $version and fabtests into $prefix (cached afterwards)" >&2
curl -fsSL -o "$work/src.tar.xz" "http://deb.debian.org/debian/pool/main/libf/libfabric/libfabric_$version.orig.tar.xz"
echo "$sha256  $work/src.tar.xz" | sha256sum -c --quiet
tar -xJf "$work/src.tar.xz" -C "$work"
src=$work/libfabric-$version
jobs=$(nproc)
(
  cd "$src"
  ./autogen.sh
  ./configure --prefix="$prefix" --disable-static --enable-only --enable-tcp --enable-rxm --enable-shm --enable-sockets
  make -j"$jobs" install
  cd fabtests
  ./autogen.sh
  ./configure --prefix="$prefix" --with-libfabric="$prefix"
  make -j"$jobs" install
) >"$work/build.log" 2>&1 || { tail -40 "$work/build.log" >&2; exit 1; }
touch "$prefix/.complete"
echo "built $prefix in $(( $(date +%s) - start ))s" >&2
echo "$prefix"
