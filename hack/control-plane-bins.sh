#!/usr/bin/env bash
# Builds the Kubernetes control-plane binaries from Go modules (nothing but the Go module
# proxy is reachable here) and caches them under ~/.cache/kvhandoff/k8s/<version>/.
# Prints that folder on stdout, for KUBEBUILDER_ASSETS.
#
#   hack/control-plane-bins.sh [binary...]   default: kube-apiserver etcd
#
# Binaries: kube-apiserver kube-scheduler kube-controller-manager kubectl (from hack/tools/kube,
# the version pinned there), a real node's kubelet and kube-proxy (hack/tools/node, the same
# version), etcd (from hack/tools/etcd) and kwok (from hack/tools/kwok). A cached binary is reused as long
# as the helper module's go.sum is unchanged; a second run takes well under a second.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
kube_mod=$here/tools/kube
node_mod=$here/tools/node
etcd_mod=$here/tools/etcd
kwok_mod=$here/tools/kwok
version=$(awk '$1=="require" && $2=="k8s.io/kubernetes" {print $3}' "$kube_mod/go.mod")
cache=${KVHANDOFF_CACHE:-$HOME/.cache/kvhandoff}/k8s/$version
mkdir -p "$cache"

bins=("$@")
[ ${#bins[@]} -gt 0 ] || bins=(kube-apiserver etcd)

build() { # build NAME MODULE_DIR PACKAGE LDFLAGS
  local name=$1 dir=$2 pkg=$3 ldflags=$4
  local stamp; stamp=$(sha256sum "$dir/go.sum" | cut -c1-16)
  if [ -x "$cache/$name" ] && [ "$(cat "$cache/.$name.stamp" 2>/dev/null)" = "$stamp" ]; then
    return
  fi
  echo "building $name ($pkg) into $cache — first time only, minutes on 2 cores" >&2
  local start=$SECONDS
  (cd "$dir" && CGO_ENABLED=0 "$here/retry.sh" go build -trimpath -ldflags "-s -w $ldflags" -o "$cache/$name.tmp" "$pkg")
  mv "$cache/$name.tmp" "$cache/$name"
  echo "$stamp" > "$cache/.$name.stamp"
  echo "built $name in $((SECONDS - start))s" >&2
}

# Stamp the version into the binaries so /version and `kubectl version` report it.
minor=$(echo "$version" | cut -d. -f2)
kube_ld="-X k8s.io/component-base/version.gitVersion=$version -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=$minor"
kube_ld+=" -X k8s.io/client-go/pkg/version.gitVersion=$version -X k8s.io/client-go/pkg/version.gitMajor=1 -X k8s.io/client-go/pkg/version.gitMinor=$minor"

for b in "${bins[@]}"; do
  case $b in
    kube-apiserver|kube-scheduler|kube-controller-manager|kubectl)
      build "$b" "$kube_mod" "k8s.io/kubernetes/cmd/$b" "$kube_ld" ;;
    kubelet|kube-proxy)
      build "$b" "$node_mod" "k8s.io/kubernetes/cmd/$b" "$kube_ld" ;;
    etcd)
      build etcd "$etcd_mod" go.etcd.io/etcd/server/v3 "" ;;
    kwok)
      build kwok "$kwok_mod" sigs.k8s.io/kwok/cmd/kwok ""
      # KWOK simulates node and pod lifecycles by Stage configs that ship in its module:
      # nodes become Ready and keep a heartbeat; pods become Running and are deleted.
      if [ ! -s "$cache/kwok-stages.yaml" ]; then
        src=$(cd "$kwok_mod" && go list -m -f '{{.Dir}}' sigs.k8s.io/kwok)/kustomize/stage
        for f in node/fast/node-initialize node/heartbeat/node-heartbeat pod/fast/pod-ready pod/fast/pod-complete pod/fast/pod-delete; do
          printf -- '---\n'; cat "$src/$f.yaml"
        done > "$cache/kwok-stages.yaml.tmp"
        mv "$cache/kwok-stages.yaml.tmp" "$cache/kwok-stages.yaml"
      fi ;;
    *) echo "control-plane-bins: unknown binary '$b' (want kube-apiserver, kube-scheduler, kube-controller-manager, kubectl, kubelet, kube-proxy, etcd or kwok)" >&2; exit 2 ;;
  esac
done
echo "$cache"
