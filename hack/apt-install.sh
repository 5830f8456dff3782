#!/usr/bin/env bash
# Installs Debian packages, quietly, as root or through sudo: the one way the hack scripts
# install what they need (each decides first what is missing).
#
#   hack/apt-install.sh PACKAGE...
set -euo pipefail
[ $# -gt 0 ] || exit 0
echo "installing Debian packages: $*" >&2
sudo=""
[ "$(id -u)" -eq 0 ] || sudo=sudo
retry=$(dirname "${BASH_SOURCE[0]}")/retry.sh
$sudo "$retry" apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo "$retry" apt-get install -y -qq --no-install-recommends "$@" >/dev/null
