// Command device-plugin advertises EFA NICs (and optionally accelerator + local EFA
// bundles) to the kubelet, with their PCIe and NUMA locality.
//
//	device-plugin [serve] [flags]     the kubelet device plugin (default)
//	device-plugin dra [flags]         the kubelet DRA plugin: ResourceSlices and CDI instead
//	device-plugin discover [flags]    print the inventory or a preferred allocation
package main

import (
	"fmt"
	"os"

	"github.com/kvhandoff/kvhandoff/internal/deviceplugin/cli"
)

func main() {
	args := os.Args[1:]
	cmd := "serve"
	if len(args) > 0 && (args[0] == "serve" || args[0] == "dra" || args[0] == "discover") {
		cmd, args = args[0], args[1:]
	}
	switch cmd {
	case "discover":
		os.Exit(cli.Discover(args, os.Stdout, os.Stderr))
	case "dra":
		os.Exit(cli.DRA(args, os.Stderr))
	case "serve":
		os.Exit(cli.Serve(args, os.Stderr))
	default:
		fmt.Fprintf(os.Stderr, "device-plugin: unknown command %q\n", cmd)
		os.Exit(2)
	}
}
