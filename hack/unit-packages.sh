#!/usr/bin/env bash
# Lists the module's packages whose tests need no API server, no agent process, no root
# and no vLLM: those whose test files import none of the harnesses that start them
# (test/envtest, test/cluster, test/agentproc, test/realnode, test/prometheus, test/kubelet).
# make unit runs them; make test runs everything.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
heavy='github.com/kvhandoff/kvhandoff/test/(envtest|cluster|agentproc|realnode|prometheus|kubelet)$'
go list -f '{{if or .TestGoFiles .XTestGoFiles}}{{.ImportPath}}{{range .TestImports}} {{.}}{{end}}{{range .XTestImports}} {{.}}{{end}}{{end}}' ./... |
  awk -v heavy="$heavy" 'NF { for (i = 2; i <= NF; i++) if ($i ~ heavy) next; print $1 }'
