// Command endpoint-picker is kvhandoff's endpoint picker for the Gateway API Inference
// Extension: the gateway's ext_proc server that picks each request's decode endpoint and
// prefill engine.
package main

import (
	"os"

	"github.com/kvhandoff/kvhandoff/internal/epp/cli"
)

func main() { os.Exit(cli.Run(os.Args[1:], os.Stderr, nil)) }
