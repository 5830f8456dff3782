// Package sysfs reads PCI functions, RDMA devices, NVIDIA GPUs and Neuron devices from a
// Linux sysfs tree under a root folder ("/" on a node, a fixture in tests). Every reader
// reports a broken entry as an error for that entry and goes on with the others.
package sysfs

import (
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
)

// Root is the folder that holds sys/ (and proc/ for NVIDIA's driver files).
type Root string

func (r Root) path(parts ...string) string {
	return filepath.Join(append([]string{string(r)}, parts...)...)
}

// PCI vendor ids kvhandoff looks for.
const (
	VendorAmazon = "0x1d0f" // EFA, Neuron, and also EC2's NVMe and ENA: never match on vendor alone
	VendorNVIDIA = "0x10de"
)

// PCIFunction is one PCI function.
type PCIFunction struct {
	// Address is the function's bus id, 0000:12:00.0.
	Address string
	Vendor  string
	Device  string
	Class   string
	// Driver is the bound kernel driver ("efa", "nvidia", "neuron"), "" when unbound.
	Driver string
	// NUMANode is the NUMA node, -1 when the platform does not say (VMs often do not).
	NUMANode int
	// Bridges are the PCI bridges above the function, from the root port down to its
	// parent: two functions under one PCIe switch share a prefix longer than the root port.
	Bridges []string
}

var pciAddress = regexp.MustCompile(`^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$`)

// PCIFunctions lists every PCI function in sys/bus/pci/devices, sorted by address.
func (r Root) PCIFunctions() ([]PCIFunction, []error) {
	entries, err := os.ReadDir(r.path("sys", "bus", "pci", "devices"))
	if err != nil {
		return nil, []error{fmt.Errorf("listing PCI functions: %w", err)}
	}
	var out []PCIFunction
	var errs []error
	for _, e := range entries {
		f, err := r.PCIFunction(e.Name())
		if err != nil {
			errs = append(errs, err)
		}
		if f.Address != "" {
			out = append(out, f)
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Address < out[j].Address })
	return out, errs
}

// PCIFunction reads one PCI function by address. A function whose identity cannot be
// read comes back empty with the error; one with a dangling driver link or an unreadable
// numa_node comes back as far as it was read (unbound, NUMA -1), with the error.
func (r Root) PCIFunction(addr string) (PCIFunction, error) {
	link := r.path("sys", "bus", "pci", "devices", addr)
	dir, err := filepath.EvalSymlinks(link)
	if err != nil {
		return PCIFunction{}, fmt.Errorf("PCI function %s: %w", addr, err)
	}
	f := PCIFunction{Address: addr, NUMANode: -1}
	for _, field := range []struct {
		name string
		into *string
	}{{"vendor", &f.Vendor}, {"device", &f.Device}, {"class", &f.Class}} {
		v, err := readTrimmed(filepath.Join(dir, field.name))
		if err != nil {
			return PCIFunction{}, fmt.Errorf("PCI function %s: %w", addr, err)
		}
		*field.into = strings.ToLower(v)
	}
	for _, part := range strings.Split(filepath.ToSlash(dir), "/") {
		if pciAddress.MatchString(part) && part != addr {
			f.Bridges = append(f.Bridges, part)
		}
	}
	var problem error
	if target, err := filepath.EvalSymlinks(filepath.Join(dir, "driver")); err == nil {
		f.Driver = filepath.Base(target)
	} else if _, lerr := os.Lstat(filepath.Join(dir, "driver")); lerr == nil {
		problem = fmt.Errorf("PCI function %s: driver link is dangling (%v); treating it as unbound", addr, err)
	}
	if v, err := readTrimmed(filepath.Join(dir, "numa_node")); err == nil {
		if n, perr := strconv.Atoi(v); perr == nil {
			f.NUMANode = n
		} else {
			problem = fmt.Errorf("PCI function %s: numa_node %q is not a number; NUMA unknown", addr, v)
		}
	}
	return f, problem
}

func readTrimmed(path string) (string, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return "", err
	}
	return strings.TrimSpace(string(b)), nil
}
