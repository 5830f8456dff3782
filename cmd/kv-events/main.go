// Command kv-events is the sidecar in each engine pod that follows vLLM's KV cache
// events and serves the keys of the blocks its engine holds to routers and pickers.
package main

import (
	"os"

	"github.com/kvhandoff/kvhandoff/internal/kvevents/cli"
)

func main() { os.Exit(cli.Run(os.Args[1:], os.Stderr, nil)) }
