package claimrails

import (
	"reflect"
	"strings"
	"testing"

	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
)

func TestRequestNames(t *testing.T) {
	for name, want := range map[string]struct {
		kind  string
		index int
		ok    bool
	}{
		"efa-3": {EFA, 3, true}, "accelerator-12": {Accelerator, 12, true}, "efa-3/any": {EFA, 3, true},
		"efa-03": {EFA, 3, false}, "efa--1": {EFA, 0, false}, "efa-": {EFA, 0, false}, "accelerators": {"", 0, false}, "gpu-0": {"", 0, false},
	} {
		kind, i, ok := Request(name)
		if ok != want.ok || (ok && (kind != want.kind || i != want.index)) {
			t.Errorf("Request(%q) = %q, %d, %v; want %+v", name, kind, i, ok, want)
		}
	}
}

// Each accelerator's EFAs come from its efa-<i> results across an engine's claims, named
// by kvhandoff's or DRANET's attribute; a device naming none is reported, not guessed.
func TestEFAsOfAnEnginesClaims(t *testing.T) {
	attrs := map[string]map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{
		"dra.kvhandoff.io/n/efa-b": {"rdmaDevice": {StringValue: ptr.To("rdmap5s0")}},
		"dra.kvhandoff.io/n/efa-a": {"dra.kvhandoff.io/rdmaDevice": {StringValue: ptr.To("rdmap4s0")}},
		"dra.net/n/pci-1":          {"dra.net/rdmaDevice": {StringValue: ptr.To("rdmap20s0")}},
		"dra.net/n/eth0":           {"dra.net/ifName": {StringValue: ptr.To("eth0")}},
	}
	claim := func(name string, results ...resourceapi.DeviceRequestAllocationResult) *resourceapi.ResourceClaim {
		return &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Name: name}, Status: resourceapi.ResourceClaimStatus{
			Allocation: &resourceapi.AllocationResult{Devices: resourceapi.DeviceAllocationResult{Results: results}}}}
	}
	r := func(req, driver, dev string) resourceapi.DeviceRequestAllocationResult {
		return resourceapi.DeviceRequestAllocationResult{Request: req, Driver: driver, Pool: "n", Device: dev}
	}
	got, problems := EFAs([]*resourceapi.ResourceClaim{
		claim("c0", r("accelerator-0", "gpu.nvidia.com", "gpu-0"), r("efa-0", "dra.kvhandoff.io", "efa-b"), r("efa-0", "dra.kvhandoff.io", "efa-a")),
		claim("c1", r("efa-6", "dra.net", "pci-1"), r("efa-7", "dra.net", "eth0")),
		{ObjectMeta: metav1.ObjectMeta{Name: "unallocated"}},
	}, func(driver, pool, device string) map[resourceapi.QualifiedName]resourceapi.DeviceAttribute {
		return attrs[driver+"/"+pool+"/"+device]
	})
	if want := map[int][]string{0: {"rdmap4s0", "rdmap5s0"}, 6: {"rdmap20s0"}}; !reflect.DeepEqual(got, want) {
		t.Errorf("EFAs = %v, want %v", got, want)
	}
	if len(problems) != 1 || !strings.Contains(problems[0], "claim c1, efa-7: dra.net/n/eth0 publishes no RDMA device name") {
		t.Errorf("problems %q", problems)
	}
}
