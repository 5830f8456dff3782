// Command router is kvhandoff's request router: an OpenAI-compatible front end that
// sends each request's prefill and decode legs to a DecodePool and its PrefillPool;
// with --local, a decode pod's leg runner.
package main

import (
	"os"

	"github.com/kvhandoff/kvhandoff/internal/router/cli"
)

func main() { os.Exit(cli.Run(os.Args[1:], os.Stderr, nil)) }
