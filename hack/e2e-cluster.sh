#!/usr/bin/env bash
# Starts or stops the simulated cluster (kube-apiserver, etcd, kube-controller-manager,
# kube-scheduler, KWOK and the nodes of test/cluster/nodes.yaml) in the background.
#
#   hack/e2e-cluster.sh up DIR     writes DIR/kubeconfig, logs under DIR/logs
#   hack/e2e-cluster.sh down DIR
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cmd=${1:?usage: e2e-cluster.sh up|down DIR} dir=${2:?usage: e2e-cluster.sh up|down DIR}

case $cmd in
up)
  if [ -f "$dir/pid" ] && kill -0 "$(cat "$dir/pid")" 2>/dev/null; then
    echo "the simulated cluster is already up: export KUBECONFIG=$dir/kubeconfig"; exit 0
  fi
  rm -rf "$dir" && mkdir -p "$dir/logs"
  (cd "$root" && go build -o "$dir/localcluster" ./hack/localcluster)
  KUBEBUILDER_ASSETS=$("$root/hack/control-plane-bins.sh" kube-apiserver etcd kube-controller-manager kube-scheduler kwok) \
    nohup "$dir/localcluster" --write-kubeconfig "$dir/kubeconfig" --log-dir "$dir/logs" >"$dir/logs/localcluster.log" 2>&1 &
  echo $! >"$dir/pid"
  for _ in $(seq 1 1200); do
    [ -s "$dir/kubeconfig" ] && break
    kill -0 "$(cat "$dir/pid")" 2>/dev/null || { cat "$dir/logs/"*.log >&2; exit 1; }
    sleep 0.1
  done
  [ -s "$dir/kubeconfig" ] || { echo "the simulated cluster did not come up in 2 minutes; logs in $dir/logs" >&2; exit 1; }
  echo "simulated cluster up; logs in $dir/logs"
  echo "export KUBECONFIG=$dir/kubeconfig"
  ;;
down)
  if [ -f "$dir/pid" ]; then
    pid=$(cat "$dir/pid")
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 1 300); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    rm -f "$dir/pid"
  fi
  echo "simulated cluster down"
  ;;
*) echo "usage: e2e-cluster.sh up|down DIR" >&2; exit 2 ;;
esac
