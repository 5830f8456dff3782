// Command transfer-agent is the node agent that executes KV handoffs between prefill
// and decode engines: see docs/transfer-agent.md.
package main

import (
	"os"

	"github.com/kvhandoff/kvhandoff/internal/transferagent/cli"
)

func main() { os.Exit(cli.Run(os.Args[1:], os.Stderr)) }
