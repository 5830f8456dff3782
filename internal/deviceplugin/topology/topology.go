// Package topology decides which devices are close: which EFAs belong to which
// accelerator, and which set of NICs a pod should get. Two devices are local when they
// sit under the same PCIe switch; NUMA is the fallback where the platform hides the
// switches, and is too coarse on its own (four GPUs share a NUMA node on p5en).
package topology

import (
	"math/bits"
	"slices"
	"sort"
)

// Device is a device as locality sees it.
type Device struct {
	ID string
	// Bridges are the PCI bridges above the device, from the root port down.
	Bridges []string
	// NUMA is the NUMA node, -1 when unknown.
	NUMA int
}

// Switch is the device's locality group: the PCIe switch below its root port (the
// second bridge), the root port when there is no switch, "" when nothing is known.
func (d Device) Switch() string {
	switch {
	case len(d.Bridges) >= 2:
		return d.Bridges[1]
	case len(d.Bridges) == 1:
		return d.Bridges[0]
	}
	return ""
}

// sameSwitch reports whether two devices share a PCIe switch: a common root port and at
// least one bridge below it.
func sameSwitch(a, b Device) bool {
	return len(a.Bridges) >= 2 && len(b.Bridges) >= 2 && a.Bridges[0] == b.Bridges[0] && a.Bridges[1] == b.Bridges[1]
}

// Locality says how an accelerator's NICs were chosen.
type Locality string

const (
	// LocalityPCIe: the NICs share the accelerator's PCIe switch.
	LocalityPCIe Locality = "pcie-switch"
	// LocalityNUMA: no shared switch is visible; the NICs share its NUMA node.
	LocalityNUMA Locality = "numa"
	// LocalityNone: neither is visible; the NICs were shared out in address order.
	LocalityNone Locality = "none"
)

// Assignment is an accelerator's NICs.
type Assignment struct {
	NICs     []string
	Locality Locality
}

// Assign gives every accelerator its local NICs. A NIC belongs to at most one
// accelerator, and no accelerator takes more than its share (NICs / accelerators,
// rounded up), so p5en's GPUs get 2 each, p5's 4, trn2's Neuron devices 1, and on trn1
// one device of each pair gets the pair's NIC.
func Assign(accelerators, nics []Device) map[string]Assignment {
	out := map[string]Assignment{}
	if len(accelerators) == 0 {
		return out
	}
	share := (len(nics) + len(accelerators) - 1) / len(accelerators)
	count := map[string]int{}
	nics = slices.Clone(nics)
	sort.Slice(nics, func(i, j int) bool { return nics[i].ID < nics[j].ID })
	for _, n := range nics {
		pick := func(ok func(a Device) bool) *Device {
			var best *Device
			for i := range accelerators {
				a := &accelerators[i]
				if count[a.ID] >= share || !ok(*a) {
					continue
				}
				if best == nil || count[a.ID] < count[best.ID] {
					best = a
				}
			}
			return best
		}
		locality := LocalityPCIe
		a := pick(func(a Device) bool { return sameSwitch(a, n) })
		if a == nil && n.NUMA >= 0 {
			locality = LocalityNUMA
			a = pick(func(a Device) bool { return a.NUMA == n.NUMA })
		}
		if a == nil {
			locality = LocalityNone
			a = pick(func(Device) bool { return true })
		}
		if a == nil {
			continue
		}
		count[a.ID]++
		as := out[a.ID]
		as.NICs = append(as.NICs, n.ID)
		if as.Locality == "" || rank(locality) > rank(as.Locality) {
			as.Locality = locality
		}
		out[a.ID] = as
	}
	return out
}

// rank orders localities from best to worst, so an assignment reports its weakest link.
func rank(l Locality) int {
	return map[Locality]int{LocalityPCIe: 0, LocalityNUMA: 1, LocalityNone: 2}[l]
}

// Preferred picks size devices out of available for one pod: all of mustInclude, then
// as few PCIe switches as possible, then as few NUMA nodes, then the lowest ids. It
// returns nil when the request cannot be met.
func Preferred(available []Device, mustInclude []string, size int) []string {
	if size > len(available) || len(mustInclude) > size {
		return nil
	}
	byID := map[string]Device{}
	for _, d := range available {
		byID[d.ID] = d
	}
	for _, id := range mustInclude {
		if _, ok := byID[id]; !ok {
			return nil
		}
	}
	groups, index := switchGroups(available)
	var required uint64
	for _, id := range mustInclude {
		required |= 1 << index[groupKey(byID[id])]
	}
	var chosen []int
	if len(groups) <= maxExactGroups {
		chosen = exact(groups, required, size)
	} else {
		chosen = greedy(groups, required, size)
	}
	return fill(groups, chosen, mustInclude, size)
}

// group is the devices behind one PCIe switch, in id order.
type group struct {
	key  string
	numa int
	ids  []string
}

// groupKey is a device's switch; a device with no known switch is a group of its own.
func groupKey(d Device) string {
	if key := d.Switch(); key != "" {
		return key
	}
	return "device:" + d.ID
}

// switchGroups groups devices by switch, in the order of their lowest ids, and indexes
// the groups by key.
func switchGroups(available []Device) ([]group, map[string]int) {
	index := map[string]int{}
	var groups []group
	for _, d := range sortedByID(available) {
		key := groupKey(d)
		i, ok := index[key]
		if !ok {
			i = len(groups)
			index[key] = i
			groups = append(groups, group{key: key, numa: d.NUMA})
		}
		groups[i].ids = append(groups[i].ids, d.ID)
	}
	return groups, index
}

// maxExactGroups bounds the exact search, which tries every set of groups (2^n).
const maxExactGroups = 20

// exact tries every set of groups that holds the required groups and enough devices, and
// returns the best by (switches, NUMA nodes, lowest group keys).
func exact(groups []group, required uint64, size int) []int {
	best, bestSwitches, bestNUMA := uint64(0), 1<<30, 1<<30
	for set := uint64(0); set < 1<<len(groups); set++ {
		if set&required != required {
			continue
		}
		total, numa := 0, map[int]bool{}
		for i := range groups {
			if set&(1<<i) != 0 {
				total += len(groups[i].ids)
				numa[groups[i].numa] = true
			}
		}
		n := bits.OnesCount64(set)
		if total < size || n > bestSwitches || (n == bestSwitches && len(numa) >= bestNUMA) {
			continue
		}
		best, bestSwitches, bestNUMA = set, n, len(numa)
	}
	var chosen []int
	for i := range groups {
		if best&(1<<i) != 0 {
			chosen = append(chosen, i)
		}
	}
	return chosen
}

// greedy is for many groups (no switches visible): the required groups, then the largest
// until there are enough devices.
func greedy(groups []group, required uint64, size int) []int {
	order := make([]int, len(groups))
	for i := range order {
		order[i] = i
	}
	sort.SliceStable(order, func(a, b int) bool {
		ra, rb := required&(1<<order[a]) != 0, required&(1<<order[b]) != 0
		if ra != rb {
			return ra
		}
		return len(groups[order[a]].ids) > len(groups[order[b]].ids)
	})
	var chosen []int
	total := 0
	for _, i := range order {
		if total >= size && required&(1<<i) == 0 {
			break
		}
		chosen = append(chosen, i)
		total += len(groups[i].ids)
	}
	return chosen
}

// fill takes mustInclude, then devices of the chosen groups in order, up to size; nil
// when they hold too few.
func fill(groups []group, chosen []int, mustInclude []string, size int) []string {
	picked := slices.Clone(mustInclude)
	taken := map[string]bool{}
	for _, id := range mustInclude {
		taken[id] = true
	}
	for _, i := range chosen {
		for _, id := range groups[i].ids {
			if len(picked) == size {
				break
			}
			if !taken[id] {
				picked = append(picked, id)
				taken[id] = true
			}
		}
	}
	if len(picked) < size {
		return nil
	}
	return picked
}

func sortedByID(ds []Device) []Device {
	out := slices.Clone(ds)
	sort.Slice(out, func(i, j int) bool { return out[i].ID < out[j].ID })
	return out
}
