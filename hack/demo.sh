#!/usr/bin/env bash
# make demo: a real kube-apiserver + etcd on loopback, kvhandoff's CRDs, the samples
# applied, and what the API server returns for them. Everything it starts is stopped on exit.
#
#   DEMO_KEEP=1 make demo   keeps the control plane up until Ctrl-C, for kubectl by hand.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

bold() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

assets=$(hack/control-plane-bins.sh kube-apiserver etcd kubectl)
kubectl=$assets/kubectl
work=$(mktemp -d /tmp/kvhandoff-demo.XXXXXX)
export KUBECONFIG=$work/kubeconfig

cluster_pid=""
cleanup() {
  if [ -n "$cluster_pid" ]; then
    kill -TERM "$cluster_pid" 2>/dev/null || true
    wait "$cluster_pid" 2>/dev/null || true
  fi
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

bold "starting kube-apiserver and etcd on loopback (binaries from $assets)"
go build -o "$work/localcluster" ./hack/localcluster
KUBEBUILDER_ASSETS=$assets "$work/localcluster" --write-kubeconfig "$KUBECONFIG" >"$work/cluster.log" 2>&1 &
cluster_pid=$!
for _ in $(seq 1 600); do
  [ -s "$KUBECONFIG" ] && break
  if ! kill -0 "$cluster_pid" 2>/dev/null; then
    echo "the local control plane failed to start:" >&2; cat "$work/cluster.log" >&2; exit 1
  fi
  sleep 0.1
done
[ -s "$KUBECONFIG" ] || { echo "the local control plane did not come up in 60s:" >&2; cat "$work/cluster.log" >&2; exit 1; }
head -1 "$work/cluster.log"
"$kubectl" version 2>/dev/null | sed 's/^/  /'

bold "kvhandoff CRDs installed"
"$kubectl" get crd -o custom-columns=NAME:.metadata.name,SHORT:.spec.names.shortNames,SCOPE:.spec.scope

bold "kubectl apply --server-side -k config/samples"
"$kubectl" apply --server-side -k config/samples

bold "kubectl get kvtp,pfp,dcp -o wide"
"$kubectl" get kvtp,pfp,dcp -o wide

bold "defaults filled in by the API server's schema: kubectl get kvtp trn2-pull -o jsonpath='{.spec}'"
"$kubectl" get kvtp trn2-pull -o jsonpath='{.spec}'
echo

bold "an invalid policy is refused: push with bidirectional KV (kubectl apply --dry-run=server)"
bad=$(cat <<'YAML'
apiVersion: kvhandoff.io/v1alpha1
kind: KVTransferPolicy
metadata:
  name: push-bidirectional
spec:
  mode: Push
  bidirectional: true
YAML
)
echo "$bad" | sed 's/^/  /'
if echo "$bad" | "$kubectl" apply --dry-run=server -f - 2>"$work/err"; then
  echo "demo: the API server accepted an invalid policy" >&2; exit 1
fi
sed 's/^/  /' "$work/err"
grep -q 'mode: Push does not support bidirectional KV' "$work/err"

bold "scaling through /scale: kubectl scale dcp qwen3-32b-decode --replicas=3"
"$kubectl" scale dcp qwen3-32b-decode --replicas=3
"$kubectl" get dcp qwen3-32b-decode

if [ "${DEMO_KEEP:-}" = 1 ]; then
  bold "control plane kept up: export KUBECONFIG=$KUBECONFIG   (Ctrl-C stops it)"
  wait "$cluster_pid"
fi
bold "demo done; stopping the control plane"
