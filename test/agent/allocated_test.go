package agent_test

import (
	"strconv"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	"github.com/kvhandoff/kvhandoff/internal/transferagent/fabric"
	agentv1 "github.com/kvhandoff/kvhandoff/transferagent/api/v1"
	"github.com/kvhandoff/kvhandoff/transferagent/client"
)

// claimedPod creates engine pod name on node with one ResourceClaim allocated as the
// scheduler does for kvhandoff's claims: accelerator-i with efa-i, efa-i's devices
// published by kvhandoff's DRA driver with the RDMA device names efas[i]. It returns the
// pod's UID.
func (k *cluster) claimedPod(name, node string, efas [][]string) string {
	k.t.Helper()
	slice := &resourceapi.ResourceSlice{ObjectMeta: metav1.ObjectMeta{Name: node + "-dra"}, Spec: resourceapi.ResourceSliceSpec{
		Driver: "dra.kvhandoff.io", NodeName: ptr.To(node), Pool: resourceapi.ResourcePool{Name: node, ResourceSliceCount: 1}}}
	claim := &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Name: name + "-devices-0"}}
	var results []resourceapi.DeviceRequestAllocationResult
	for i, group := range efas {
		for _, req := range []string{"accelerator-" + strconv.Itoa(i), "efa-" + strconv.Itoa(i)} {
			claim.Spec.Devices.Requests = append(claim.Spec.Devices.Requests, resourceapi.DeviceRequest{Name: req,
				Exactly: &resourceapi.ExactDeviceRequest{DeviceClassName: "efa.kvhandoff.io"}})
		}
		results = append(results, resourceapi.DeviceRequestAllocationResult{Request: "accelerator-" + strconv.Itoa(i), Driver: "gpu.nvidia.com",
			Pool: node, Device: "gpu-" + strconv.Itoa(i)})
		for _, rdma := range group {
			slice.Spec.Devices = append(slice.Spec.Devices, resourceapi.Device{Name: "efa-" + rdma,
				Attributes: map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{"rdmaDevice": {StringValue: ptr.To(rdma)}}})
			results = append(results, resourceapi.DeviceRequestAllocationResult{Request: "efa-" + strconv.Itoa(i), Driver: "dra.kvhandoff.io",
				Pool: node, Device: "efa-" + rdma})
		}
	}
	if _, err := k.c.ResourceV1().ResourceSlices().Create(bg, slice, metav1.CreateOptions{}); err != nil {
		k.t.Fatal(err)
	}
	claim, err := k.c.ResourceV1().ResourceClaims("default").Create(bg, claim, metav1.CreateOptions{})
	if err != nil {
		k.t.Fatal(err)
	}
	claim.Status.Allocation = &resourceapi.AllocationResult{Devices: resourceapi.DeviceAllocationResult{Results: results}}
	if _, err := k.c.ResourceV1().ResourceClaims("default").UpdateStatus(bg, claim, metav1.UpdateOptions{}); err != nil {
		k.t.Fatal(err)
	}
	pod, err := k.c.CoreV1().Pods("default").Create(bg, &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: corev1.PodSpec{NodeName: node, Containers: []corev1.Container{{Name: "engine", Image: "vllm",
			Resources: corev1.ResourceRequirements{Claims: []corev1.ResourceClaim{{Name: "devices-0"}}}}},
			ResourceClaims: []corev1.PodResourceClaim{{Name: "devices-0", ResourceClaimName: ptr.To(claim.Name)}}},
	}, metav1.CreateOptions{})
	if err != nil {
		k.t.Fatal(err)
	}
	pod.Status.ResourceClaimStatuses = []corev1.PodResourceClaimStatus{{Name: "devices-0", ResourceClaimName: ptr.To(claim.Name)}}
	if _, err := k.c.CoreV1().Pods("default").UpdateStatus(bg, pod, metav1.UpdateOptions{}); err != nil {
		k.t.Fatal(err)
	}
	return string(pod.UID)
}

// TestARankUsesOnlyTheEFAsItsPodWasAllocated: where DRA gave an engine pod its EFAs, the
// agent reads them from the pod's claims and the node's slices (with its own RBAC) and
// holds each rank to one accelerator's: a rank naming another pod's NIC, or NICs of two
// accelerators, is refused; a rank naming none gets accelerator tp_rank's instead of the
// provider's first NIC. The agent does the RDMA writes, so this is where an engine that
// names NICs it was not given is stopped.
func TestARankUsesOnlyTheEFAsItsPodWasAllocated(t *testing.T) {
	const prov = "tcp;ofi_rxm" // domains are interface names: the "RDMA devices" here
	have, err := fabric.Domains(prov)
	if err != nil || len(have) < 2 {
		t.Fatalf("this test needs two NICs of %s (lo and eth0), has %v (%v)", prov, have, err)
	}
	first, second := have[0], have[len(have)-1]
	k := newCluster(t)
	k.node("p5en-a")
	engine := k.claimedPod("decode-0", "p5en-a", [][]string{{first}, {second}})
	other := k.pod("other-0", "p5en-a")
	a := k.agent("allocated", "p5en-a", "--provider", prov)
	register := func(cgroup string, r *agentv1.RegisterEngineRequest) error {
		t.Helper()
		k.standIn(cgroup)
		cl, err := client.Dial(a.Socket)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { cl.Close() })
		e, err := cl.RegisterEngine(bg, r)
		if err == nil {
			t.Cleanup(e.Close)
		}
		return err
	}
	rank := func(id string, r uint32, domains ...string) *agentv1.RegisterEngineRequest {
		req := decodeEngine(id)
		req.TpSize, req.TpRank, req.FabricDomains = 2, r, domains
		return req
	}

	err = register(systemdCgroup(engine), rank("decode-0.default", 0, "no-such-efa"))
	wantErr(t, "a NIC the pod was not allocated", err, "PermissionDenied", "are not the EFAs of one of this pod's accelerators")
	err = register(systemdCgroup(engine), rank("decode-0.default", 0, first, second))
	wantErr(t, "two accelerators' NICs for one rank", err, "PermissionDenied", "are not the EFAs of one of this pod's accelerators")
	if err := register(systemdCgroup(engine), rank("decode-0.default", 0, first)); err != nil {
		t.Fatalf("rank 0 naming accelerator 0's EFA: %v", err)
	}
	if err := register(systemdCgroup(engine), rank("decode-0.default", 1)); err != nil {
		t.Fatalf("rank 1 naming none: %v", err)
	}
	if !a.WaitLog(`"rails":["`+second+`"]`, 10*time.Second) {
		t.Errorf("rank 1, naming no NIC, is not on accelerator 1's (%s):\n%s", second, a.Log())
	}
	// A pod without claims names its NICs as before.
	if err := register(systemdCgroup(other), rank("other-0.default", 0, second)); err != nil {
		t.Errorf("a pod without claims: %v", err)
	}
}
