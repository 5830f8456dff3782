#!/usr/bin/env bash
# Installs what `make test` and `make demo` need on a fresh Debian machine with Go:
# Debian packages that are missing, and the control-plane binaries (built from Go modules
# and cached under ~/.cache/kvhandoff). Safe to run again: a second run only checks.
#
#   hack/install-deps.sh [control-plane binary...]   default: kube-apiserver etcd
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

# Debian packages, by the file that proves each is present.
declare -A want=(
  [libfabric-dev]=/usr/include/rdma/fabric.h
  [libfabric-bin]=/usr/bin/fi_info
  [pkg-config]=/usr/bin/pkg-config
  [protobuf-compiler]=/usr/bin/protoc
  # The images (make images): Debian bases, and the distroless bases' CA bundle.
  [mmdebstrap]=/usr/bin/mmdebstrap
  [ca-certificates]=/etc/ssl/certs/ca-certificates.crt
  # The real node (test/realnode): container runtime, and the node's networking.
  [containerd]=/usr/bin/containerd
  [runc]=/usr/sbin/runc
  [iptables]=/usr/sbin/iptables-restore
  [iproute2]=/usr/sbin/ip
)
missing=()
for pkg in "${!want[@]}"; do
  [ -e "${want[$pkg]}" ] || missing+=("$pkg")
done
"$here/apt-install.sh" ${missing[@]+"${missing[@]}"}

"$here/control-plane-bins.sh" "$@" >/dev/null
