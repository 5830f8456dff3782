#!/usr/bin/env bash
# Builds the Prometheus server from its Go module (pinned in hack/tools/prometheus, the
# version promtool comes from) once, and prints its path. Service discovery is left out
# (remove_all_sd): the tests scrape static targets on loopback.
exec "$(dirname "${BASH_SOURCE[0]}")/module-tool.sh" prometheus prometheus github.com/prometheus/prometheus \
  github.com/prometheus/prometheus/cmd/prometheus "" remove_all_sd
