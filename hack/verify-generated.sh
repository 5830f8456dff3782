#!/usr/bin/env bash
# Fails when the generated files in the tree (CRDs, RBAC, DeepCopy, the agent's gRPC code) differ from what
# controller-gen makes from the markers now. Generates into a scratch copy of the
# module, so the working tree is never touched.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
gen=${CONTROLLER_GEN:-$root/bin/controller-gen}
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT

tar -C "$root" --exclude=./bin --exclude=./.git -cf - . | tar -C "$scratch" -xf -
(cd "$scratch" && make -s generate manifests proto CONTROLLER_GEN="$gen" \
  PROTOC_GEN_GO="${PROTOC_GEN_GO:-$root/bin/protoc-gen-go}" PROTOC_GEN_GO_GRPC="${PROTOC_GEN_GO_GRPC:-$root/bin/protoc-gen-go-grpc}" >/dev/null)

status=0
for path in api config/crd/bases config/rbac charts/kvhandoff/crds charts/kvhandoff/templates/manager-role.yaml transferagent/api vllm-connector/kvhandoff_vllm/_api; do
  [ -e "$root/$path" ] || [ -e "$scratch/$path" ] || continue
  if ! diff -ruN "$root/$path" "$scratch/$path" >"$scratch/diff.txt"; then
    echo "generated files under $path are out of date; run 'make generate manifests' and commit:" >&2
    head -40 "$scratch/diff.txt" >&2
    status=1
  fi
done
[ $status -eq 0 ] && echo "generated files are up to date"
exit $status
