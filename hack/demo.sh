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

cluster_pid="" manager_pid=""
cleanup() {
  for pid in $manager_pid $cluster_pid; do
    kill -TERM "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  done
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

bold "kubectl apply --server-side -k config/default   (CRDs, RBAC, manager Deployment: the install a cluster gets)"
"$kubectl" apply --server-side -k config/default | sed 's/^/  /'

bold "starting the manager locally (the binary of the image; no kubelet runs its Deployment here)"
go build -o "$work/manager" ./cmd/manager
"$work/manager" --kubeconfig "$KUBECONFIG" --metrics-bind-address=0 --health-probe-bind-address=127.0.0.1:0 >"$work/manager.log" 2>&1 &
manager_pid=$!

bold "kubectl apply --server-side -k config/samples"
"$kubectl" apply --server-side -k config/samples

bold "the engines the manager rendered"
for i in $(seq 1 300); do
  [ "$("$kubectl" get statefulsets -o name | wc -l)" -ge 4 ] && break
  kill -0 "$manager_pid" 2>/dev/null || { echo "the manager exited:" >&2; cat "$work/manager.log" >&2; exit 1; }
  sleep 0.1
done
"$kubectl" get statefulsets,services -l app.kubernetes.io/managed-by=kvhandoff -L kvhandoff.io/role
for pool in qwen3-32b-prefill qwen3-32b-decode llama-70b-decode; do
  bold "engine container of $pool"
  "$kubectl" get statefulset "$pool" -o go-template-file=hack/engine.gotmpl
done

bold "pool conditions (no kubelets here, so engines are created but never ready)"
"$kubectl" get pfp,dcp -o custom-columns='KIND:.kind,NAME:.metadata.name,READY:.status.conditions[?(@.type=="Ready")].reason,DEGRADED:.status.conditions[?(@.type=="Degraded")].status,PAIRED:.status.conditions[?(@.type=="Paired")].reason,MESSAGE:.status.conditions[?(@.type=="Ready")].message'

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

bold "an invalid pair is reported, not rendered: a TP 4 decode pool for the TP 8 prefill pool"
"$kubectl" apply --server-side -f - <<'YAML'
apiVersion: kvhandoff.io/v1alpha1
kind: DecodePool
metadata:
  name: qwen3-32b-decode-tp4
spec:
  model: Qwen/Qwen3-32B
  image: vllm/vllm-openai:v0.29.0
  tensorParallelSize: 4
  accelerator: {type: NvidiaGPU}
  instanceType: p5en.48xlarge
  transferPolicyRef: {name: p5en-push}
  prefillPoolRef: {name: qwen3-32b-prefill}
YAML
for i in $(seq 1 300); do
  reason=$("$kubectl" get dcp qwen3-32b-decode-tp4 -o jsonpath='{.status.conditions[?(@.type=="Ready")].reason}')
  [ -n "$reason" ] && break
  sleep 0.1
done
"$kubectl" get dcp qwen3-32b-decode-tp4 -o jsonpath='{range .status.conditions[*]}  {.type}={.status} {.reason}: {.message}{"\n"}{end}'
[ "$reason" = TensorParallelMismatch ] || { echo "demo: expected TensorParallelMismatch, got '$reason'" >&2; exit 1; }
if "$kubectl" get statefulset qwen3-32b-decode-tp4 >/dev/null 2>&1; then
  echo "demo: an invalid pair got engines" >&2; exit 1
fi
"$kubectl" get events --field-selector involvedObject.name=qwen3-32b-decode-tp4 -o custom-columns=TYPE:.type,REASON:.reason,MESSAGE:.message | head -5

bold "scaling through /scale: kubectl scale dcp qwen3-32b-decode --replicas=3"
"$kubectl" scale dcp qwen3-32b-decode --replicas=3
for i in $(seq 1 300); do
  [ "$("$kubectl" get statefulset qwen3-32b-decode -o jsonpath='{.spec.replicas}')" = 3 ] && break
  sleep 0.1
done
"$kubectl" get dcp qwen3-32b-decode
"$kubectl" get statefulset qwen3-32b-decode

if [ "${DEMO_KEEP:-}" = 1 ]; then
  bold "control plane kept up: export KUBECONFIG=$KUBECONFIG   (Ctrl-C stops it)"
  wait "$cluster_pid"
fi
bold "demo done; stopping the control plane"
