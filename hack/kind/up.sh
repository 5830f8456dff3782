#!/usr/bin/env bash
# Creates a kind cluster with fake accelerator nodes and kvhandoff's CRDs and RBAC, for
# running test/e2e on your own machine (needs docker, kind and network access to GitHub
# for KWOK's release manifests). Then:
#   KUBECONFIG=$(kind get kubeconfig-path) ... see docs/testing.md
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
kwok_version=v0.8.0

kind create cluster --config "$root/hack/kind/kind-config.yaml"
kubectl config use-context kind-kvhandoff

# KWOK runs in the cluster and plays the kubelet of every node annotated kwok.x-k8s.io/node=fake.
kubectl apply -f "https://github.com/kubernetes-sigs/kwok/releases/download/$kwok_version/kwok.yaml"
kubectl apply -f "https://github.com/kubernetes-sigs/kwok/releases/download/$kwok_version/stage-fast.yaml"
kubectl -n kube-system rollout status deployment/kwok-controller --timeout=3m

# The same nodes as the simulated cluster: 4 p5en + 2 trn2 in one zone, 2 p5en in another.
(cd "$root" && go run ./hack/fakenodes)
kubectl wait --for=condition=Ready node -l type=kwok --timeout=3m

kubectl apply --server-side -k "$root/config/default"
echo "kind cluster kvhandoff is ready; see docs/testing.md to run the suite"
