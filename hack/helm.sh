#!/usr/bin/env bash
# Builds helm from its Go module (pinned in hack/tools/helm) once, and prints its path.
exec "$(dirname "${BASH_SOURCE[0]}")/module-tool.sh" helm helm helm.sh/helm/v3 helm.sh/helm/v3/cmd/helm \
  "-X helm.sh/helm/v3/internal/version.version=VERSION"
