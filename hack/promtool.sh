#!/usr/bin/env bash
# Builds promtool from Prometheus's Go module (pinned in hack/tools/prometheus) once, and
# prints its path.
exec "$(dirname "${BASH_SOURCE[0]}")/module-tool.sh" prometheus promtool github.com/prometheus/prometheus \
  github.com/prometheus/prometheus/cmd/promtool
