// Package instancetype holds what kvhandoff knows about EC2 accelerator instance types:
// which accelerator they carry and how many EFA interfaces sit next to each accelerator.
package instancetype

import (
	"fmt"
	"slices"
	"strings"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
)

// Info describes one instance type.
type Info struct {
	// Accelerator is the kind of accelerator the instance carries.
	Accelerator kvv1.AcceleratorType
	// Accelerators is the number of accelerator devices (GPUs or Neuron devices).
	Accelerators int32
	// EFA is the number of EFA interfaces.
	EFA int32
}

// EFAFor returns the EFA interfaces that go with n accelerators: the NICs that share a
// PCIe switch with them. When NICs are fewer than accelerators (trn1: one NIC per two
// devices), a partial share rounds up so every accelerator reaches a NIC.
func (i Info) EFAFor(n int32) int32 {
	return (n*i.EFA + i.Accelerators - 1) / i.Accelerators
}

// known is the table; the numbers are AWS's published instance specifications.
var known = map[string]Info{
	"p5en.48xlarge": {Accelerator: kvv1.AcceleratorNvidiaGPU, Accelerators: 8, EFA: 16}, // H200, 16 × 200 Gbps
	"p5e.48xlarge":  {Accelerator: kvv1.AcceleratorNvidiaGPU, Accelerators: 8, EFA: 32}, // H200, 32 × 100 Gbps
	"p5.48xlarge":   {Accelerator: kvv1.AcceleratorNvidiaGPU, Accelerators: 8, EFA: 32}, // H100, 32 × 100 Gbps
	"trn2.48xlarge": {Accelerator: kvv1.AcceleratorNeuron, Accelerators: 16, EFA: 16},
	"trn1.32xlarge": {Accelerator: kvv1.AcceleratorNeuron, Accelerators: 16, EFA: 8},
}

// Lookup returns what is known about an instance type.
func Lookup(name string) (Info, bool) {
	i, ok := known[name]
	return i, ok
}

// Names lists the known instance types, sorted, for messages.
func Names() string { return strings.Join(Accelerated(), ", ") }

// EFACount is the number of vpc.amazonaws.com/efa an engine pod with the given
// accelerators requests: the policy's efaPerAccelerator when set, else the instance
// type's NICs local to those accelerators.
func EFACount(accelerators int32, instanceType string, efaPerAccelerator int32) (int32, error) {
	if efaPerAccelerator > 0 {
		return accelerators * efaPerAccelerator, nil
	}
	info, ok := Lookup(instanceType)
	if !ok {
		if instanceType == "" {
			return 0, fmt.Errorf("the pool sets no instanceType and the policy no fabric.efaPerAccelerator, so the number of EFA interfaces is "+
				"unknown; set spec.instanceType (one of %s) or the policy's spec.fabric.efaPerAccelerator", Names())
		}
		return 0, fmt.Errorf("instanceType %q is not in kvhandoff's table (%s), so the number of EFA interfaces is unknown; set the policy's "+
			"spec.fabric.efaPerAccelerator", instanceType, Names())
	}
	return info.EFAFor(accelerators), nil
}

// Accelerated lists every instance type of the table, sorted: all of them carry
// accelerators, and programs that need none (the router) keep off them.
func Accelerated() []string {
	names := make([]string, 0, len(known))
	for n := range known {
		names = append(names, n)
	}
	slices.Sort(names)
	return names
}
