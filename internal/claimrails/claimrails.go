// Package claimrails reads which EFAs Dynamic Resource Allocation gave each accelerator
// of an engine: the claims kvhandoff's manager renders ask for accelerator i as request
// accelerator-<i> and for its own EFAs as request efa-<i> (render.AcceleratorRequest,
// render.EFARequest), so a claim's allocation results pair them whichever drivers
// published the devices. The DRA driver uses it to write each rank's EFAs into the
// container, and the transfer agent to hold each rank to the EFAs its pod was allocated.
package claimrails

import (
	"fmt"
	"slices"
	"strconv"
	"strings"

	resourceapi "k8s.io/api/resource/v1"
)

// Request kinds, the prefixes of a claim's request names.
const (
	Accelerator = "accelerator-"
	EFA         = "efa-"
)

// Request splits a request name into its kind and accelerator index: ("efa-", 3) for
// efa-3. A subrequest (request/subrequest, firstAvailable) counts as its request.
func Request(name string) (kind string, index int, ok bool) {
	name, _, _ = strings.Cut(name, "/")
	for _, prefix := range []string{Accelerator, EFA} {
		if rest, found := strings.CutPrefix(name, prefix); found {
			i, err := strconv.Atoi(rest)
			return prefix, i, err == nil && i >= 0 && strconv.Itoa(i) == rest
		}
	}
	return "", 0, false
}

// rdmaAttributes are the attributes that carry an EFA's RDMA device name (rdmap79s0):
// kvhandoff's driver's rdmaDevice, in its own domain, and DRANET's dra.net/rdmaDevice
// (kubernetes-sigs/dranet pkg/apis/attributes.go), which EKS ships as its EFA driver.
var rdmaAttributes = []string{"rdmaDevice", "dra.net/rdmaDevice"}

// RDMADevice is the RDMA device name a device of driver publishes, "" when none.
func RDMADevice(driver string, attrs map[resourceapi.QualifiedName]resourceapi.DeviceAttribute) string {
	for _, key := range append([]string{driver + "/rdmaDevice"}, rdmaAttributes...) {
		if a, ok := attrs[resourceapi.QualifiedName(key)]; ok && a.StringValue != nil {
			return *a.StringValue
		}
	}
	return ""
}

// Attributes returns the attributes of an allocated device ((driver, pool, device) of an
// allocation result), nil when no slice read has it.
type Attributes func(driver, pool, device string) map[resourceapi.QualifiedName]resourceapi.DeviceAttribute

// EFAs returns each accelerator's EFAs (RDMA device names, sorted) by accelerator index,
// from the efa-<i> results of claims. An allocated device that names no RDMA device is
// reported, never guessed.
func EFAs(claims []*resourceapi.ResourceClaim, attrs Attributes) (map[int][]string, []string) {
	out := map[int][]string{}
	var problems []string
	for _, c := range claims {
		if c.Status.Allocation == nil {
			continue
		}
		for _, r := range c.Status.Allocation.Devices.Results {
			kind, i, ok := Request(r.Request)
			if !ok || kind != EFA {
				continue
			}
			name := RDMADevice(r.Driver, attrs(r.Driver, r.Pool, r.Device))
			if name == "" {
				problems = append(problems, fmt.Sprintf("claim %s, %s: %s/%s/%s publishes no RDMA device name", c.Name, r.Request, r.Driver, r.Pool, r.Device))
				continue
			}
			out[i] = append(out[i], name)
		}
	}
	for i := range out {
		slices.Sort(out[i])
	}
	return out, problems
}
