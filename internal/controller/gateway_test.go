package controller

import (
	. "github.com/onsi/ginkgo/v2"
	. "github.com/onsi/gomega"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"
	infv1 "sigs.k8s.io/gateway-api-inference-extension/api/v1"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
)

// Ordered: the cluster starts without the InferencePool CRD, which the second spec
// installs while the manager runs.
var _ = Describe("A DecodePool behind a gateway", Ordered, func() {
	var ns string
	var d *kvv1.DecodePool

	It("gets its endpoint picker and leg runners, and says when the cluster has no InferencePool CRD", func() {
		ns, _, _, d = readyPair()
		update(d, func(d *kvv1.DecodePool) { d.Spec.Gateway.InferencePool = true })

		dep := &appsv1.Deployment{}
		Eventually(func() error { return k8s.Get(ctx, key(ns, "d-epp"), dep) }).Should(Succeed())
		Expect(metav1.IsControlledBy(dep, d)).To(BeTrue())
		Expect(dep.Spec.Template.Spec.Containers[0].Args).To(ContainElements("--decode-pool=d", "--leg-runner-port=8100"))
		svc := &corev1.Service{}
		// Applied after the Deployment.
		Eventually(func() error { return k8s.Get(ctx, key(ns, "d-epp"), svc) }).Should(Succeed())
		Expect(svc.Spec.Ports).To(ConsistOf(And(HaveField("Name", "grpc"), HaveField("Port", BeEquivalentTo(9002)))))
		// Only the gateway's pods reach the picker's gRPC port; pickerClients replaces them.
		np := &networkingv1.NetworkPolicy{}
		Expect(k8s.Get(ctx, key(ns, "d-epp"), np)).To(Succeed()) // applied before the Deployment
		Expect(np.Spec.Ingress[0].From).To(HaveLen(2))
		update(d, func(d *kvv1.DecodePool) {
			d.Spec.Gateway.PickerClients = []kvv1.PickerClient{{IPBlock: &kvv1.PickerIPBlock{CIDR: "198.18.0.0/24"}}}
		})
		Eventually(func(g Gomega) {
			g.Expect(k8s.Get(ctx, key(ns, "d-epp"), np)).To(Succeed())
			g.Expect(np.Spec.Ingress[0].From).To(ConsistOf(HaveField("IPBlock.CIDR", "198.18.0.0/24")))
		}).Should(Succeed())

		sts := statefulSet(ns, "d")
		Eventually(func(g Gomega) {
			g.Expect(k8s.Get(ctx, client.ObjectKeyFromObject(sts), sts)).To(Succeed())
			g.Expect(sts.Spec.Template.Spec.ServiceAccountName).To(Equal("d-leg-runner"))
			g.Expect(sts.Spec.Template.Spec.InitContainers).To(ContainElement(HaveField("Name", "leg-runner")))
		}).Should(Succeed())
		Expect(k8s.Get(ctx, key(ns, "d-leg-runner"), &corev1.ServiceAccount{})).To(Succeed())

		Eventually(func() metav1.Condition { return condition(d, kvv1.ConditionInferencePoolReady) }).Should(And(
			HaveField("Status", metav1.ConditionFalse), HaveField("Reason", kvv1.ReasonInferencePoolCRDMissing)))
		expectEvent(d, kvv1.ReasonInferencePoolCRDMissing)
		// Informational: the pool still serves through its router.
		Expect(condition(d, kvv1.ConditionDegraded).Status).To(Equal(metav1.ConditionFalse))
	})

	It("renders the InferencePool once the CRD is installed, and surfaces a gateway's report on it", func() {
		Expect(env.InstallGatewayCRDs()).To(Succeed())
		// The manager started without the CRD: the pool looks for it again on its own
		// (every second here, a minute by default), and applying the InferencePool starts
		// the watch on it.
		ip := &infv1.InferencePool{}
		Eventually(func() error { return k8s.Get(ctx, key(ns, "d"), ip) }).Should(Succeed())
		update(d, func(d *kvv1.DecodePool) { d.Spec.Gateway.FailureMode = kvv1.GatewayFailOpen })
		Eventually(func() infv1.EndpointPickerFailureMode {
			Expect(k8s.Get(ctx, key(ns, "d"), ip)).To(Succeed())
			return ip.Spec.EndpointPickerRef.FailureMode
		}).Should(Equal(infv1.EndpointPickerFailOpen))
		Expect(metav1.IsControlledBy(ip, d)).To(BeTrue())
		Expect(ip.Spec.TargetPorts).To(ConsistOf(infv1.Port{Number: 8100}))
		Expect(ip.Spec.Selector.MatchLabels).To(Equal(map[infv1.LabelKey]infv1.LabelValue{kvv1.LabelPool: "d", kvv1.LabelRole: "decode"}))
		Expect(ip.Spec.EndpointPickerRef).To(And(HaveField("Name", infv1.ObjectName("d-epp")), HaveField("Port", &infv1.Port{Number: 9002}),
			HaveField("FailureMode", infv1.EndpointPickerFailOpen)))
		Eventually(func() metav1.Condition { return condition(d, kvv1.ConditionInferencePoolReady) }).Should(And(
			HaveField("Status", metav1.ConditionUnknown), HaveField("Reason", kvv1.ReasonNoParentGateway)))

		// A gateway reports it refused, then accepted: the watch brings each report.
		report := func(accepted metav1.ConditionStatus, reason string) {
			Expect(k8s.Get(ctx, key(ns, "d"), ip)).To(Succeed())
			ip.Status.Parents = []infv1.ParentStatus{{
				ParentRef: infv1.ParentReference{Kind: "Gateway", Name: "inference-gateway", Namespace: infv1.Namespace(ns)},
				Conditions: []metav1.Condition{
					{Type: "Accepted", Status: accepted, Reason: reason, Message: "as the gateway says", LastTransitionTime: metav1.Now()},
					{Type: "ResolvedRefs", Status: metav1.ConditionTrue, Reason: "ResolvedRefs", LastTransitionTime: metav1.Now()},
				},
			}}
			Expect(k8s.Status().Update(ctx, ip)).To(Succeed())
		}
		report(metav1.ConditionFalse, "NotSupportedByParent")
		Eventually(func() metav1.Condition { return condition(d, kvv1.ConditionInferencePoolReady) }).Should(And(
			HaveField("Status", metav1.ConditionFalse), HaveField("Reason", kvv1.ReasonNotAccepted),
			HaveField("Message", ContainSubstring(ns+"/inference-gateway: Accepted NotSupportedByParent"))))
		expectEvent(d, kvv1.ReasonNotAccepted)
		report(metav1.ConditionTrue, "Accepted")
		Eventually(func() metav1.Condition { return condition(d, kvv1.ConditionInferencePoolReady) }).Should(And(
			HaveField("Status", metav1.ConditionTrue), HaveField("Reason", kvv1.ReasonInferencePoolAccepted)))
	})

	It("removes the gateway's objects, the sidecar and the condition when the pool leaves the gateway", func() {
		update(d, func(d *kvv1.DecodePool) { d.Spec.Gateway.InferencePool = false })
		for _, c := range []struct {
			name string
			obj  client.Object
		}{
			{"d", &infv1.InferencePool{}}, {"d-epp", &appsv1.Deployment{}}, {"d-epp", &corev1.Service{}}, {"d-epp", &policyv1.PodDisruptionBudget{}},
			{"d-leg-runner", &corev1.ServiceAccount{}}, {"d-leg-runner", &rbacv1.Role{}}, {"d-leg-runner", &rbacv1.RoleBinding{}},
		} {
			Eventually(func() bool { return apierrors.IsNotFound(k8s.Get(ctx, key(ns, c.name), c.obj)) }).Should(BeTrue(), "%T %s is removed", c.obj, c.name)
		}
		sts := statefulSet(ns, "d")
		Eventually(func(g Gomega) {
			g.Expect(k8s.Get(ctx, client.ObjectKeyFromObject(sts), sts)).To(Succeed())
			g.Expect(sts.Spec.Template.Spec.ServiceAccountName).To(BeEmpty())
			g.Expect(sts.Spec.Template.Spec.InitContainers).NotTo(ContainElement(HaveField("Name", "leg-runner")))
		}).Should(Succeed())
		Eventually(func() bool {
			Expect(k8s.Get(ctx, client.ObjectKeyFromObject(d), d)).To(Succeed())
			for _, c := range d.Status.Conditions {
				if c.Type == kvv1.ConditionInferencePoolReady {
					return false
				}
			}
			return true
		}).Should(BeTrue())
		// The router stays.
		Expect(k8s.Get(ctx, key(ns, "d-router"), &appsv1.Deployment{})).To(Succeed())
	})
})
