package e2e

import (
	"fmt"
	"os"
	"slices"
	"strings"

	. "github.com/onsi/ginkgo/v2"
	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
	"github.com/kvhandoff/kvhandoff/internal/deviceplugin/dra"
	"github.com/kvhandoff/kvhandoff/test/cluster"
)

// draPool is a PrefillPool of one engine under allocation DRA, pinned to a node group.
func draPool(name, nodeGroup, instanceType, accType string, count int, dra string) string {
	return fmt.Sprintf(`
apiVersion: kvhandoff.io/v1alpha1
kind: PrefillPool
metadata: {name: %s}
spec:
  model: Qwen/Qwen3-32B
  image: "vllm/vllm-openai:v0.29.0"
  tensorParallelSize: %d
  accelerator: {type: %s, count: %d, allocation: DRA, dra: %s}
  instanceType: %s
  transferPolicyRef: {name: push}
  template: {spec: {nodeSelector: {eks.amazonaws.com/nodegroup: %s}}}
`, name, min(count, 16), accType, count, dra, instanceType, nodeGroup)
}

// claimsOf returns the allocated ResourceClaims of a pod's device claims (devices-<k>).
func claimsOf(pod corev1.Pod) []*resourceapi.ResourceClaim {
	var claims []*resourceapi.ResourceClaim
	Eventually(func(g Gomega) {
		claims = nil
		g.Expect(k8s.Get(ctx, client.ObjectKeyFromObject(&pod), &pod)).To(Succeed())
		g.Expect(pod.Status.ResourceClaimStatuses).To(HaveLen(len(pod.Spec.ResourceClaims)))
		for _, s := range pod.Status.ResourceClaimStatuses {
			claim := &resourceapi.ResourceClaim{}
			g.Expect(k8s.Get(ctx, client.ObjectKey{Namespace: pod.Namespace, Name: ptr.Deref(s.ResourceClaimName, "")}, claim)).To(Succeed())
			g.Expect(claim.Status.Allocation).NotTo(BeNil())
			claims = append(claims, claim)
		}
	}).Should(Succeed())
	return claims
}

// nodeSlices indexes the devices of a node's ResourceSlices by driver/pool/device.
func nodeSlices(node string) map[string]resourceapi.Device {
	list := &resourceapi.ResourceSliceList{}
	Expect(k8s.List(ctx, list, client.MatchingFields{"spec.nodeName": node})).To(Succeed())
	out := map[string]resourceapi.Device{}
	for _, s := range list.Items {
		for _, d := range s.Spec.Devices {
			out[s.Spec.Driver+"/"+s.Spec.Pool.Name+"/"+d.Name] = d
		}
	}
	return out
}

// allocationRow checks a claim's allocation against the node's fixture: each
// accelerator-i shares the locality attribute with every device of efa-i, and its EFAs are
// exactly those the device plugin's bundles give it (same PCIe switch). It returns the
// table row: what was allocated, and how many ranks' rails are PCIe-local.
func allocationRow(shape, instanceType string, pod corev1.Pod, locality string) string {
	devices := nodeSlices(pod.Spec.NodeName)
	attr := func(r resourceapi.DeviceRequestAllocationResult) string {
		d, ok := devices[r.Driver+"/"+r.Pool+"/"+r.Device]
		Expect(ok).To(BeTrue(), "%s/%s/%s is in no slice of %s", r.Driver, r.Pool, r.Device, pod.Spec.NodeName)
		return ptr.Deref(d.Attributes[resourceapi.QualifiedName(locality)].StringValue, "")
	}
	inv, _, err := cluster.Machine(GinkgoT().TempDir(), instanceType, pod.Spec.NodeName)
	Expect(err).NotTo(HaveOccurred())
	claims := claimsOf(pod)
	accelerators, efas, local := 0, 0, 0
	for _, claim := range claims {
		roots := map[string]string{}
		for _, r := range claim.Status.Allocation.Devices.Results {
			if i, ok := strings.CutPrefix(r.Request, "accelerator-"); ok {
				roots[i] = attr(r)
				accelerators++
			}
		}
		for _, r := range claim.Status.Allocation.Devices.Results {
			if i, ok := strings.CutPrefix(r.Request, "efa-"); ok {
				Expect(attr(r)).To(Equal(roots[i]), "%s: %s is not on accelerator-%s's %s", claim.Name, r.Device, i, locality)
				efas++
			}
		}
		rails, problems := dra.Rails(claim, inv, func(driver, pool, device string) map[resourceapi.QualifiedName]resourceapi.DeviceAttribute {
			return devices[driver+"/"+pool+"/"+device].Attributes
		})
		Expect(problems).To(BeEmpty())
		for _, rail := range rails {
			for _, b := range inv.Bundles {
				acc, _ := inv.Lookup(b.Accelerator)
				named := acc.UUID == rail.Accelerator || (acc.UUID == "" && fmt.Sprint(acc.Index) == rail.Accelerator)
				if named && len(rail.EFAs) > 0 && slices.Equal(b.EFAs, rail.EFAs) {
					local++
				}
			}
		}
	}
	Expect(local).To(Equal(accelerators), "every rank's rails are its accelerator's own EFAs (the fixture's bundles)")
	return fmt.Sprintf("| %s | %s | %d accelerators, %d EFAs (%d each) in %d claim(s), %s | %d/%d |", instanceType, shape, accelerators, efas,
		efas/max(accelerators, 1), len(claims), locality, local, accelerators)
}

var _ = Describe("Devices by DRA", Label("dra"), func() {
	It("schedules each accelerator with its own PCIe-local EFAs, from kvhandoff's driver and from NVIDIA's, AWS's and DRANET's", func() {
		rows := []string{"| node | DRA drivers | allocated per engine | ranks with PCIe-local rails |", "|---|---|---|---|"}
		for _, c := range []struct {
			shape, group, instanceType, accType string
			count                               int
			dra, locality                       string
		}{
			{"kvhandoff", "p5en-kvh", "p5en.48xlarge", "NvidiaGPU", 8, "{deviceClassName: gpu.kvhandoff.io}", kvv1.AttributePCIeRoot},
			{"kvhandoff (pcieSwitch)", "p5en-kvh", "p5en.48xlarge", "NvidiaGPU", 8,
				"{deviceClassName: gpu.kvhandoff.io, localityAttribute: dra.kvhandoff.io/pcieSwitch}", "dra.kvhandoff.io/pcieSwitch"},
			{"NVIDIA + DRANET", "p5en-nv", "p5en.48xlarge", "NvidiaGPU", 8, "{efaDeviceClassName: " + cluster.ThirdPartyEFAClass + "}", kvv1.AttributePCIeRoot},
			{"kvhandoff", "p5-kvh", "p5.48xlarge", "NvidiaGPU", 8, "{deviceClassName: gpu.kvhandoff.io}", kvv1.AttributePCIeRoot},
			{"NVIDIA + DRANET", "p5-nv", "p5.48xlarge", "NvidiaGPU", 8, "{efaDeviceClassName: " + cluster.ThirdPartyEFAClass + "}", kvv1.AttributePCIeRoot},
			{"kvhandoff", "trn2-kvh", "trn2.48xlarge", "Neuron", 16, "{deviceClassName: neuron.kvhandoff.io}", kvv1.AttributePCIeRoot},
			{"AWS Neuron + DRANET", "trn2-aws", "trn2.48xlarge", "Neuron", 16, "{efaDeviceClassName: " + cluster.ThirdPartyEFAClass + "}", kvv1.AttributePCIeRoot},
		} {
			By(fmt.Sprintf("a TP engine of %d %s on %s (%s)", c.count, c.accType, c.group, c.shape))
			ns := namespace()
			applyYAML(ns, pushPolicy+draPool("p", c.group, c.instanceType, c.accType, c.count, c.dra))
			pod := running(ns, "p", kvv1.RolePrefill, 1)[0]
			Expect(pod.Spec.Containers[0].Resources.Limits).To(BeEmpty(), "no extended resources under DRA")
			Expect(pod.Spec.NodeName).To(HavePrefix(c.group + "-"))
			rows = append(rows, allocationRow(c.shape, c.instanceType, pod, c.locality))
		}
		table := strings.Join(rows, "\n")
		AddReportEntry("DRA allocations", table)
		fmt.Fprintln(GinkgoWriter, table)
		if out := os.Getenv("KVHANDOFF_DRA_TABLE"); out != "" {
			Expect(os.WriteFile(out, []byte(table+"\n"), 0o644)).To(Succeed())
		}
	})

	It("keeps an engine whose claim no node can satisfy Pending, with the scheduler's reason and the claim in the pool's status", func() {
		ns := namespace()
		applyYAML(ns, `
apiVersion: kvhandoff.io/v1alpha1
kind: KVTransferPolicy
metadata: {name: push}
spec: {mode: Push, fabric: {efaPerAccelerator: 3}}
---`+draPool("p", "p5en-kvh", "p5en.48xlarge", "NvidiaGPU", 8, "{deviceClassName: gpu.kvhandoff.io}"))
		Eventually(func(g Gomega) {
			c := conditionOf(poolStatus(ns, "p", kvv1.RolePrefill), kvv1.ConditionDegraded)
			g.Expect(c.Reason).To(Equal(kvv1.ReasonDevicesUnallocatable))
			g.Expect(c.Message).To(ContainSubstring("cannot allocate all claims"))
			g.Expect(c.Message).To(ContainSubstring("each engine claims 8 device(s) of DeviceClass gpu.kvhandoff.io, each with 3 EFA(s)"))
		}).Should(Succeed())
		Expect(poolPods(ns, "p", kvv1.RolePrefill)).To(ConsistOf(HaveField("Spec.NodeName", "")))
	})

	It("keeps a pair Paired while its decode pool rolls from the device plugins onto DRA", func() {
		ns := namespace()
		applyYAML(ns, pushPolicy+draPool("p", "p5en-kvh", "p5en.48xlarge", "NvidiaGPU", 8, "{deviceClassName: gpu.kvhandoff.io}")+`---
apiVersion: kvhandoff.io/v1alpha1
kind: DecodePool
metadata: {name: d}
spec:
  model: Qwen/Qwen3-32B
  image: "vllm/vllm-openai:v0.29.0"
  tensorParallelSize: 8
  accelerator: {type: NvidiaGPU}
  instanceType: p5en.48xlarge
  transferPolicyRef: {name: push}
  prefillPoolRef: {name: p}
  router: {enabled: false}
  template: {spec: {nodeSelector: {eks.amazonaws.com/nodegroup: p5en-c}, tolerations: [{key: CriticalAddonsOnly, operator: Exists}]}}
`)
		paired := func() {
			Eventually(func(g Gomega) {
				d := poolStatus(ns, "d", kvv1.RoleDecode)
				g.Expect(conditionOf(d, kvv1.ConditionPaired).Status).To(Equal(metav1.ConditionTrue))
				g.Expect(d.CompatHash).To(Equal(poolStatus(ns, "p", kvv1.RolePrefill).CompatHash))
			}).Should(Succeed())
		}
		Expect(running(ns, "d", kvv1.RoleDecode, 1)[0].Spec.NodeName).To(Equal("p5en-c-0"))
		paired()
		mustKubectl(ns, "patch", "dcp", "d", "--type=merge", "-p",
			`{"spec":{"accelerator":{"allocation":"DRA","dra":{"deviceClassName":"gpu.kvhandoff.io"}},"template":{"spec":{"nodeSelector":{"eks.amazonaws.com/nodegroup":"p5en-kvh"}}}}}`)
		Eventually(func(g Gomega) {
			pods := poolPods(ns, "d", kvv1.RoleDecode)
			g.Expect(pods).To(HaveLen(1))
			g.Expect(pods[0].Spec.NodeName).To(HavePrefix("p5en-kvh-"))
			g.Expect(pods[0].Status.Phase).To(Equal(corev1.PodRunning))
		}).Should(Succeed())
		paired()
	})
})
