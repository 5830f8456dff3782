#!/usr/bin/env bash
# Makes (once) and prints a Python venv under ~/.cache/kvhandoff/venv, named for the hash
# of a requirements file, with exactly that file installed (--no-deps: every package is
# pinned in the file). Wheels are cached under ~/.cache/kvhandoff/pip, so a rebuilt venv
# downloads nothing. Needs python3 with venv (Debian: python3-venv, installed if missing).
#
#   hack/python-venv.sh REQUIREMENTS_FILE   → prints the venv's path
set -euo pipefail
req=$1
cache=${KVHANDOFF_CACHE:-$HOME/.cache/kvhandoff}
if ! python3 -c 'import venv, ensurepip' 2>/dev/null; then
  "$(dirname "$0")/apt-install.sh" python3-venv
fi
hash=$( (python3 --version; cat "$req") | sha256sum | cut -c1-16)
venv=$cache/venv/$(basename "$req" .txt)-$hash
if [ ! -e "$venv/.complete" ]; then
  start=$(date +%s)
  echo "building $venv from $req (cached afterwards)" >&2
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$(dirname "$0")/retry.sh" "$venv/bin/pip" install -q --disable-pip-version-check --cache-dir "$cache/pip" --no-deps -r "$req" >&2
  touch "$venv/.complete"
  echo "built $venv in $(( $(date +%s) - start ))s" >&2
fi
echo "$venv"
