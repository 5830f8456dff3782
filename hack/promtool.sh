#!/usr/bin/env bash
# Prints the path of promtool from Debian's prometheus package (unpacked once, no service).
exec "$(dirname "${BASH_SOURCE[0]}")/debian-tool.sh" prometheus usr/bin/promtool
