// Package cli holds the device plugin's commands: serve (the kubelet plugin) and
// discover (the inventory, for people and scripts).
package cli

import (
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"strings"
	"text/tabwriter"

	"github.com/kvhandoff/kvhandoff/internal/deviceplugin/inventory"
	"github.com/kvhandoff/kvhandoff/internal/deviceplugin/nvml"
	"github.com/kvhandoff/kvhandoff/internal/deviceplugin/server"
)

// Discover runs `device-plugin discover`: it prints the inventory, or with --prefer the
// allocation the plugin would prefer.
func Discover(args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("discover", flag.ContinueOnError)
	fs.SetOutput(stderr)
	root := fs.String("sysfs-root", "/", "folder holding sys/ and proc/")
	devRoot := fs.String("dev-root", "/dev", "folder holding the device nodes")
	useNVML := fs.Bool("nvml", true, "ask NVML about GPUs (UUIDs, NVLink)")
	output := fs.String("o", "table", "output: table or json")
	prefer := fs.String("prefer", "",
		"print the preferred allocation for this resource ("+server.ResourceEFA+", "+server.ResourceGPUEFA+", "+server.ResourceNeuronEFA+")")
	size := fs.Int("size", 0, "with --prefer: how many devices")
	available := fs.String("available", "", "with --prefer: comma-separated available ids (default: all)")
	must := fs.String("must-include", "", "with --prefer: comma-separated ids the allocation must include")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	inv := inventory.Discover(options(*root, *devRoot, *useNVML))

	if *prefer != "" {
		ids, err := server.Prefer(inv, *prefer, split(*available), split(*must), *size)
		if err != nil {
			fmt.Fprintln(stderr, "discover:", err)
			return 1
		}
		fmt.Fprintln(stdout, strings.Join(ids, ","))
		return 0
	}
	switch *output {
	case "json":
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		if err := enc.Encode(inv); err != nil {
			fmt.Fprintln(stderr, "discover:", err)
			return 1
		}
	case "table":
		printTable(stdout, inv)
	default:
		fmt.Fprintf(stderr, "discover: -o %q: want table or json\n", *output)
		return 2
	}
	return 0
}

// options opens NVML when asked and says what became of it.
func options(root, devRoot string, useNVML bool) inventory.Options {
	o := inventory.Options{Root: root, DevRoot: devRoot, NVMLStatus: "disabled"}
	if useNVML {
		n, err := nvml.Open()
		if err != nil {
			o.NVMLStatus = "unavailable: " + err.Error()
		} else {
			o.NVML, o.NVMLStatus = n, "ok"
		}
	}
	return o
}

func split(s string) []string {
	if s == "" {
		return nil
	}
	return strings.Split(s, ",")
}

func printTable(w io.Writer, inv inventory.Inventory) {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "KIND\tID\tPCI\tNUMA\tSWITCH\tHEALTHY\tDEVICE NODES")
	for _, d := range inv.Devices {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%s\t%t\t%s\n", d.Kind, d.ID, d.PCIBusID, d.NUMANode, d.Switch, d.Healthy, strings.Join(d.DeviceNodes, " "))
	}
	tw.Flush()
	if len(inv.Bundles) > 0 {
		fmt.Fprintln(w)
		fmt.Fprintln(tw, "BUNDLE\tLOCALITY\tEFAS")
		for _, b := range inv.Bundles {
			fmt.Fprintf(tw, "%s\t%s\t%s\n", b.ID, b.Locality, strings.Join(b.EFAs, ","))
		}
		tw.Flush()
	}
	fmt.Fprintf(w, "\nNVML: %s\n", inv.NVML)
	for _, p := range inv.Problems {
		fmt.Fprintf(w, "problem: %s\n", p)
	}
}
