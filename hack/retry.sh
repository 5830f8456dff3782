#!/usr/bin/env bash
# Runs a command that reaches a package registry, up to three times, 10 s apart, so a
# passing network failure does not fail a whole first run; says so on stderr each time.
#
#   hack/retry.sh COMMAND [ARG...]
set -uo pipefail
for try in 1 2 3; do
  "$@" && exit 0
  rc=$?
  [ $try -lt 3 ] || break
  echo "retry: '$1' failed (exit $rc), try $((try + 1)) of 3 in 10 s — a registry may have been unreachable for a moment" >&2
  sleep 10
done
echo "retry: '$*' failed 3 times (exit $rc)" >&2
exit $rc
