package controller

import (
	"strings"

	. "github.com/onsi/ginkgo/v2"
	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	resourcev1 "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
	"github.com/kvhandoff/kvhandoff/internal/render"
	"github.com/kvhandoff/kvhandoff/test/builder"
)

// claimTemplates lists the claim templates of pool name in ns.
func claimTemplates(ns, name string, role kvv1.Role) []resourcev1.ResourceClaimTemplate {
	list := &resourcev1.ResourceClaimTemplateList{}
	Expect(k8s.List(ctx, list, client.InNamespace(ns), client.MatchingLabels(render.SelectorLabels(role, name)))).To(Succeed())
	return list.Items
}

var _ = Describe("Devices by claim (allocation DRA)", func() {
	It("renders the pool's claim template before its engines, rolls onto a changed one and deletes the old once rolled out", func() {
		ns := freshNamespace()
		pol, p := builder.Policy("policy").Obj(), builder.PrefillPool("p").DRA(nil).Obj()
		create(ns, pol, p)
		sts := statefulSet(ns, "p")
		claims := sts.Spec.Template.Spec.ResourceClaims
		Expect(claims).To(HaveLen(1))
		Expect(sts.Spec.Template.Spec.Containers[0].Resources.Limits).NotTo(HaveKey(corev1.ResourceName("nvidia.com/gpu")))
		Expect(sts.Spec.Template.Spec.Containers[0].Resources.Limits).NotTo(HaveKey(corev1.ResourceName("vpc.amazonaws.com/efa")))
		first := ptr.Deref(claims[0].ResourceClaimTemplateName, "")
		var tmpl resourcev1.ResourceClaimTemplate
		Expect(k8s.Get(ctx, key(ns, first), &tmpl)).To(Succeed())
		Expect(metav1.IsControlledBy(&tmpl, p)).To(BeTrue())
		Expect(tmpl.Spec.Spec.Devices.Requests).To(HaveLen(16), "8 GPUs and each one's EFAs")
		Expect(tmpl.Spec.Spec.Devices.Requests[1].Exactly.Count).To(BeEquivalentTo(2), "p5en: two EFAs per GPU")

		update(p, func(p *kvv1.PrefillPool) {
			p.Spec.Accelerator.DRA = &kvv1.DRASpec{EFADeviceClassName: "efa.example.com"}
		})
		var second string
		Eventually(func() string {
			second = ptr.Deref(statefulSet(ns, "p").Spec.Template.Spec.ResourceClaims[0].ResourceClaimTemplateName, "")
			return second
		}).ShouldNot(Equal(first))
		Expect(claimTemplates(ns, "p", kvv1.RolePrefill)).To(HaveLen(2), "the old template stays while engines of its revision may be made")
		markRolledOut(statefulSet(ns, "p"), 0)
		Eventually(func() []string {
			var names []string
			for _, t := range claimTemplates(ns, "p", kvv1.RolePrefill) {
				names = append(names, t.Name)
			}
			return names
		}).Should(ConsistOf(second))
	})

	It("names the claim and the scheduler's reason when no node can allocate it", func() {
		ns := freshNamespace()
		pol, p := builder.Policy("policy").Obj(), builder.PrefillPool("p").DRA(nil).Obj()
		create(ns, pol, p)
		sts := statefulSet(ns, "p")
		addEnginePod(sts, 0, "", "198.18.0.9")
		pod := &corev1.Pod{}
		Expect(k8s.Get(ctx, key(ns, "p-0"), pod)).To(Succeed())
		const says = "0/6 nodes are available: 6 cannot allocate all claims."
		pod.Status.Conditions = []corev1.PodCondition{{Type: corev1.PodScheduled, Status: corev1.ConditionFalse,
			Reason: corev1.PodReasonUnschedulable, Message: says}}
		Expect(k8s.Status().Update(ctx, pod)).To(Succeed())
		Eventually(func(g Gomega) {
			c := condition(p, kvv1.ConditionDegraded)
			g.Expect(c.Reason).To(Equal(kvv1.ReasonDevicesUnallocatable))
			g.Expect(c.Message).To(HavePrefix("1 engine(s) cannot be scheduled (p-0): " + says))
			g.Expect(c.Message).To(ContainSubstring("each engine claims 8 device(s) of DeviceClass gpu.nvidia.com, each with 2 EFA(s) of " +
				"DeviceClass efa.kvhandoff.io of equal resource.kubernetes.io/pcieRoot"))
		}).Should(Succeed())
		Expect(strings.Count(condition(p, kvv1.ConditionReady).Reason, kvv1.ReasonDevicesUnallocatable)).To(Equal(1))
	})
})
