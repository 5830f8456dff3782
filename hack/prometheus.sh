#!/usr/bin/env bash
# Prints the path of the Prometheus server from Debian's prometheus package (unpacked once,
# no service started): the tests run it on loopback with static targets.
exec "$(dirname "${BASH_SOURCE[0]}")/debian-tool.sh" prometheus usr/bin/prometheus
