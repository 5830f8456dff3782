#!/usr/bin/env bash
# make demo: the whole operator, twice over. First on a simulated cluster: a real
# kube-apiserver, etcd, kube-controller-manager and kube-scheduler on loopback, KWOK
# playing the kubelets of fake p5en and trn2 nodes, kvhandoff installed from
# config/default, its manager running, the samples applied, what it renders and reports;
# then two transfer agents on loopback pushing one verified request. Then on a real node
# (hack/realnode-demo, root): the images built here, the Helm chart installed on a real
# kubelet with containerd, a CPU pair of pools per mode running as pods, one chat request
# through each router Service, the agent pod's account of the KV it moved, one request
# through Envoy, and the pull pair autoscaled up under load and back down after it.
# Everything it starts is stopped on exit.
#
#   DEMO_KEEP=1 make demo   keeps both clusters up until Ctrl-C, for kubectl by hand.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

bold() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
# columns 'NAME:path' ...: kubectl's custom-columns, one argument per column.
columns() { local IFS=,; echo "$*"; }
# until_ok 'CONDITION': evaluate the shell condition every 0.1 s until it holds, for up to
# 60 s (the demo's only waiting; the tests use Eventually).
until_ok() {
  for _ in $(seq 1 600); do eval "$1" >/dev/null 2>&1 && return 0; sleep 0.1; done
  echo "demo: timed out waiting for: $1" >&2; return 1
}

assets=$(hack/control-plane-bins.sh kube-apiserver etcd kube-controller-manager kube-scheduler kwok kubectl kubelet kube-proxy)
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

bold "starting the simulated cluster on loopback (binaries built from Go modules, in $assets)"
go build -o "$work/localcluster" ./hack/localcluster
go build -o "$work/manager" ./cmd/manager
mkdir -p "$work/logs"
KUBEBUILDER_ASSETS=$assets "$work/localcluster" --write-kubeconfig "$KUBECONFIG" --log-dir "$work/logs" >"$work/logs/localcluster.log" 2>&1 &
cluster_pid=$!
for _ in $(seq 1 1200); do
  [ -s "$KUBECONFIG" ] && break
  kill -0 "$cluster_pid" 2>/dev/null || { echo "the simulated cluster failed to start:" >&2; tail -n 20 "$work/logs/"*.log >&2; exit 1; }
  sleep 0.1
done
[ -s "$KUBECONFIG" ] || { echo "the simulated cluster did not come up in 2 minutes" >&2; exit 1; }
"$kubectl" version 2>/dev/null | sed 's/^/  /'
"$kubectl" get nodes \
  -o custom-columns="$(columns \
    'NODE:.metadata.name' 'READY:.status.conditions[?(@.type=="Ready")].status' \
    'INSTANCE-TYPE:.metadata.labels.node\.kubernetes\.io/instance-type' 'ZONE:.metadata.labels.topology\.kubernetes\.io/zone' \
    'GPU:.status.allocatable.nvidia\.com/gpu' 'NEURON:.status.allocatable.aws\.amazon\.com/neuron' 'EFA:.status.allocatable.vpc\.amazonaws\.com/efa')"

bold "kubectl apply --server-side -k config/default   (CRDs, generated RBAC, the manager's Deployment)"
"$kubectl" apply --server-side -k config/default | sed 's/^/  /'

bold "running the manager binary (the image's) against the cluster"
"$work/manager" --kubeconfig "$KUBECONFIG" --metrics-bind-address=0 --health-probe-bind-address=0 >"$work/logs/manager.log" 2>&1 &
manager_pid=$!

bold "kubectl apply --server-side -k config/samples   (a P5en push pair and a trn2 pull pair)"
"$kubectl" apply --server-side -k config/samples | sed 's/^/  /'

bold "the engines the scheduler placed (decode never on a node of its prefill pool, both in one zone)"
until_ok 'test "$("$kubectl" get pods -l kvhandoff.io/role --field-selector=status.phase=Running -o name | wc -l)" -ge 4'
"$kubectl" get pods -l kvhandoff.io/role -o custom-columns="$(columns 'POD:.metadata.name' 'ROLE:.metadata.labels.kvhandoff\.io/role' \
  'NODE:.spec.nodeName' 'POD-IP:.status.podIP' 'PHASE:.status.phase' 'COMPAT-HASH:.metadata.labels.kvhandoff\.io/compat-hash')"

bold "each DecodePool's router: a Deployment off the accelerator nodes, and the Service clients use"
until_ok 'test "$("$kubectl" get pods -l kvhandoff.io/router --field-selector=status.phase=Running -o name | wc -l)" -ge 4'
"$kubectl" get pods -l kvhandoff.io/router -o custom-columns="$(columns 'POD:.metadata.name' \
  'ROUTES-TO:.metadata.labels.kvhandoff\.io/router' 'NODE:.spec.nodeName' 'PHASE:.status.phase')"
"$kubectl" get svc -l kvhandoff.io/router | sed 's/^/  /'

bold "kubectl get kvtp,pfp,dcp -o wide"
until_ok 'test "$("$kubectl" get dcp qwen3-32b-decode -o jsonpath='\''{.status.conditions[?(@.type=="Paired")].status}'\'')" = True'
"$kubectl" get kvtp,pfp,dcp -o wide

bold "what a router reads: kubectl get dcp qwen3-32b-decode -o jsonpath='{.status.engines}'"
"$kubectl" get dcp qwen3-32b-decode -o jsonpath='{.status.engines}'; echo
bold "pool conditions"
"$kubectl" get pfp,dcp -o custom-columns="$(columns 'KIND:.kind' 'NAME:.metadata.name' \
  'READY:.status.conditions[?(@.type=="Ready")].reason' 'DEGRADED:.status.conditions[?(@.type=="Degraded")].status' \
  'PAIRED:.status.conditions[?(@.type=="Paired")].reason' 'MESSAGE:.status.conditions[?(@.type=="Ready")].message')"

bold "the engine container the manager rendered for qwen3-32b-decode"
"$kubectl" get statefulset qwen3-32b-decode -o go-template-file=hack/engine.gotmpl
bold "... and for llama-70b-prefill (trn2, pull)"
"$kubectl" get statefulset llama-70b-prefill -o go-template-file=hack/engine.gotmpl

bold "an invalid policy is refused at apply time: push with bidirectional KV (--dry-run=server)"
bad='{"apiVersion":"kvhandoff.io/v1alpha1","kind":"KVTransferPolicy","metadata":{"name":"push-bidirectional"},"spec":{"mode":"Push","bidirectional":true}}'
echo "  $bad"
if echo "$bad" | "$kubectl" apply --dry-run=server -f - 2>"$work/err"; then
  echo "demo: the API server accepted an invalid policy" >&2; exit 1
fi
sed 's/^/  /' "$work/err"
grep -q 'mode: Push does not support bidirectional KV' "$work/err"

bold "an invalid pair is reported, not rendered: a TP 4 decode pool for the TP 8 prefill pool"
"$kubectl" apply --server-side -f - <<'YAML' | sed 's/^/  /'
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
until_ok 'test -n "$("$kubectl" get dcp qwen3-32b-decode-tp4 -o jsonpath='\''{.status.conditions[?(@.type=="Ready")].reason}'\'')"'
"$kubectl" get dcp qwen3-32b-decode-tp4 -o jsonpath='{range .status.conditions[*]}  {.type}={.status} {.reason}: {.message}{"\n"}{end}'
reason=$("$kubectl" get dcp qwen3-32b-decode-tp4 -o jsonpath='{.status.conditions[?(@.type=="Ready")].reason}')
[ "$reason" = TensorParallelMismatch ] || { echo "demo: expected TensorParallelMismatch, got '$reason'" >&2; exit 1; }
if "$kubectl" get statefulset qwen3-32b-decode-tp4 >/dev/null 2>&1; then
  echo "demo: an invalid pair got engines" >&2; exit 1
fi
"$kubectl" delete dcp qwen3-32b-decode-tp4 >/dev/null

bold "kubectl scale dcp qwen3-32b-decode --replicas=4   (more engines than one zone has free nodes)"
"$kubectl" scale dcp qwen3-32b-decode --replicas=4 | sed 's/^/  /'
until_ok 'test "$("$kubectl" get pods -l kvhandoff.io/pool=qwen3-32b-decode,kvhandoff.io/role=decode -o name | wc -l)" -eq 4'
until_ok 'test -n "$("$kubectl" get dcp qwen3-32b-decode -o jsonpath='\''{.status.conditions[?(@.reason=="EnginesUnschedulable")].message}'\'')"'
"$kubectl" get pods -l kvhandoff.io/pool=qwen3-32b-decode,kvhandoff.io/role=decode -o custom-columns='POD:.metadata.name,NODE:.spec.nodeName,PHASE:.status.phase'
"$kubectl" get dcp qwen3-32b-decode -o jsonpath='{range .status.conditions[?(@.type=="Degraded")]}  {.type}={.status} {.reason}: {.message}{"\n"}{end}'

bold "transfer agents: two agents as processes on loopback push one request's KV (real libfabric, tcp;ofi_rxm)"
(cd "$root" && go run ./bench/cmd/bench-handoff --demo)

if [ "${DEMO_KEEP:-}" = 1 ]; then
  bold "simulated cluster kept up: export KUBECONFIG=$KUBECONFIG   (until Ctrl-C ends the real node below)"
fi

bold "the real node: kvhandoff as pods, installed from its chart (hack/realnode-demo)"
go build -o "$work/realnode-demo" ./hack/realnode-demo
KUBEBUILDER_ASSETS=$assets "$work/realnode-demo"

bold "demo done; stopping the simulated cluster"
