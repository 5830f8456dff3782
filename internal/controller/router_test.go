package controller

import (
	. "github.com/onsi/ginkgo/v2"
	. "github.com/onsi/gomega"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
	"github.com/kvhandoff/kvhandoff/internal/render"
	"github.com/kvhandoff/kvhandoff/test/builder"
)

var _ = Describe("Router", func() {
	It("renders a router for each DecodePool with least privilege, and names its Service in status", func() {
		ns, _, _, d := readyPair()
		dep := &appsv1.Deployment{}
		Eventually(func() error { return k8s.Get(ctx, key(ns, "d-router"), dep) }).Should(Succeed())
		Expect(metav1.IsControlledBy(dep, d)).To(BeTrue())
		Expect(*dep.Spec.Replicas).To(BeEquivalentTo(2), "two replicas by default")
		Expect(dep.Spec.Template.Labels).NotTo(HaveKey(kvv1.LabelRole), "router pods must never be taken for engines")
		Expect(dep.Spec.Template.Labels).To(HaveKeyWithValue(kvv1.LabelPool, "d"), "the manager caches router pods to poll their health")
		Expect(dep.Spec.Template.Spec.Containers[0].Image).To(Equal(render.DefaultRouterImage))
		Expect(dep.Spec.Template.Spec.Containers[0].Args).To(ContainElement("--decode-pool=d"))
		Expect(dep.Spec.Template.Spec.ServiceAccountName).To(Equal("d-router"))

		svc := &corev1.Service{}
		// The Service and PodDisruptionBudget are applied after the Deployment.
		Eventually(func() error { return k8s.Get(ctx, key(ns, "d-router"), svc) }).Should(Succeed())
		Expect(svc.Spec.Ports).To(HaveLen(1))
		Expect(svc.Spec.Ports[0]).To(And(HaveField("Name", "http"), HaveField("Port", BeEquivalentTo(8000))))
		Eventually(func() error { return k8s.Get(ctx, key(ns, "d-router"), &policyv1.PodDisruptionBudget{}) }).Should(Succeed())
		Expect(k8s.Get(ctx, key(ns, "d-router"), &corev1.ServiceAccount{})).To(Succeed())
		role := &rbacv1.Role{}
		Expect(k8s.Get(ctx, key(ns, "d-router"), role)).To(Succeed())
		for _, rule := range role.Rules {
			Expect(rule.Verbs).To(ConsistOf("get", "list", "watch"), "the router only reads")
			Expect(rule.Resources).To(Or(ConsistOf("decodepools", "prefillpools"), ConsistOf("pods")))
		}
		rb := &rbacv1.RoleBinding{}
		Expect(k8s.Get(ctx, key(ns, "d-router"), rb)).To(Succeed())
		Expect(rb.Subjects).To(ConsistOf(rbacv1.Subject{Kind: "ServiceAccount", Name: "d-router", Namespace: ns}))

		Eventually(func() string {
			Expect(k8s.Get(ctx, client.ObjectKeyFromObject(d), d)).To(Succeed())
			return d.Status.RouterService
		}).Should(Equal("d-router"))
	})

	It("undoes a hand edit of the router and removes the router when the pool disables it", func() {
		ns, _, _, d := readyPair()
		dep := &appsv1.Deployment{}
		Eventually(func() error { return k8s.Get(ctx, key(ns, "d-router"), dep) }).Should(Succeed())
		dep.Spec.Replicas = ptr.To[int32](7)
		Expect(k8s.Update(ctx, dep)).To(Succeed())
		Eventually(func() int32 { Expect(k8s.Get(ctx, key(ns, "d-router"), dep)).To(Succeed()); return *dep.Spec.Replicas }).Should(BeEquivalentTo(2))

		update(d, func(d *kvv1.DecodePool) { d.Spec.Router.Enabled = ptr.To(false) })
		for _, obj := range []client.Object{&appsv1.Deployment{}, &corev1.Service{}, &policyv1.PodDisruptionBudget{},
			&rbacv1.RoleBinding{}, &rbacv1.Role{}, &corev1.ServiceAccount{}} {
			Eventually(func() bool { return apierrors.IsNotFound(k8s.Get(ctx, key(ns, "d-router"), obj)) }).Should(BeTrue(), "%T is removed", obj)
		}
		Eventually(func() string {
			Expect(k8s.Get(ctx, client.ObjectKeyFromObject(d), d)).To(Succeed())
			return d.Status.RouterService
		}).Should(BeEmpty())
		// The engines stay.
		Expect(k8s.Get(ctx, key(ns, "d"), &appsv1.StatefulSet{})).To(Succeed())
	})

	It("takes each engine's sizes and compat-hash from its pod, so a rollout never advertises an old pod with new sizes", func() {
		ns, _, p, _ := readyPair()
		Expect(k8s.Get(ctx, client.ObjectKeyFromObject(p), p)).To(Succeed())
		oldHash := p.Status.CompatHash
		Expect(oldHash).NotTo(BeEmpty())
		update(p, func(p *kvv1.PrefillPool) { p.Spec.TensorParallelSize, p.Spec.Replicas = 4, ptr.To[int32](2) })
		sts := statefulSet(ns, "p")
		Eventually(func() string {
			Expect(k8s.Get(ctx, client.ObjectKeyFromObject(sts), sts)).To(Succeed())
			return sts.Spec.Template.Labels[kvv1.LabelTensorParallelSize]
		}).Should(Equal("4"))
		// The new template's pod joins beside the old one.
		addEnginePod(sts, 1, "node-c", "198.18.0.3")
		Eventually(func(g Gomega) {
			g.Expect(k8s.Get(ctx, client.ObjectKeyFromObject(p), p)).To(Succeed())
			g.Expect(p.Status.Engines).To(HaveLen(2))
			g.Expect(p.Status.Engines[0]).To(And(HaveField("PodName", "p-0"), HaveField("TensorParallelSize", BeEquivalentTo(8)),
				HaveField("CompatHash", oldHash)))
			g.Expect(p.Status.Engines[1]).To(And(HaveField("PodName", "p-1"), HaveField("TensorParallelSize", BeEquivalentTo(4))))
		}).Should(Succeed())
	})

	It("publishes only the StatefulSet's own pods as engines, not a pod that copied the pool's labels or owner", func() {
		ns, _, p, _ := readyPair()
		sts := statefulSet(ns, "p")
		for _, foreign := range []*corev1.Pod{
			{ObjectMeta: metav1.ObjectMeta{Name: "p-9", Namespace: ns, Labels: sts.Spec.Template.Labels}},
			// The StatefulSet's owner reference, copied, on an ordinal above its replicas.
			{ObjectMeta: metav1.ObjectMeta{Name: "p-5", Namespace: ns, Labels: sts.Spec.Template.Labels,
				OwnerReferences: []metav1.OwnerReference{*metav1.NewControllerRef(sts, appsv1.SchemeGroupVersion.WithKind("StatefulSet"))}}},
			{ObjectMeta: metav1.ObjectMeta{Name: "evil", Namespace: ns, Labels: sts.Spec.Template.Labels,
				OwnerReferences: []metav1.OwnerReference{*metav1.NewControllerRef(sts, appsv1.SchemeGroupVersion.WithKind("StatefulSet"))}}},
		} {
			foreign.Spec = corev1.PodSpec{Containers: []corev1.Container{{Name: "c", Image: "attacker"}}}
			Expect(k8s.Create(ctx, foreign)).To(Succeed())
			foreign.Status.PodIP, foreign.Status.PodIPs = "198.18.9.9", []corev1.PodIP{{IP: "198.18.9.9"}}
			foreign.Status.Conditions = []corev1.PodCondition{{Type: corev1.PodReady, Status: corev1.ConditionTrue}}
			Expect(k8s.Status().Update(ctx, foreign)).To(Succeed())
		}
		// A change the status shows, made after the foreign pods: once it is there, they
		// were seen.
		pod := &corev1.Pod{}
		Expect(k8s.Get(ctx, key(ns, "p-0"), pod)).To(Succeed())
		pod.Status.Conditions = []corev1.PodCondition{{Type: corev1.PodReady, Status: corev1.ConditionFalse}}
		Expect(k8s.Status().Update(ctx, pod)).To(Succeed())
		Eventually(func(g Gomega) {
			g.Expect(k8s.Get(ctx, client.ObjectKeyFromObject(p), p)).To(Succeed())
			g.Expect(p.Status.Engines).To(ConsistOf(And(HaveField("PodName", "p-0"), HaveField("Ready", false))))
		}).Should(Succeed())
	})

	It("takes over no foreign object of a router's names, labelled as kvhandoff's or not, and applies none of the set", func() {
		ns := freshNamespace()
		// Unlabelled, so not in the manager's cache: it once read as absent and was
		// force-applied (its subjects replaced, its owner set to the pool).
		foreign := &rbacv1.RoleBinding{ObjectMeta: metav1.ObjectMeta{Name: "d-router", Namespace: ns},
			RoleRef:  rbacv1.RoleRef{APIGroup: "rbac.authorization.k8s.io", Kind: "ClusterRole", Name: "view"},
			Subjects: []rbacv1.Subject{{Kind: "User", Name: "alice", APIGroup: "rbac.authorization.k8s.io"}}}
		Expect(k8s.Create(ctx, foreign)).To(Succeed())
		d := builder.DecodePool("d", "p").Obj()
		create(ns, builder.Policy("policy").Obj(), builder.PrefillPool("p").Obj(), d)
		Eventually(func() string { return condition(d, kvv1.ConditionReady).Message }).Should(ContainSubstring("RoleBinding d-router already exists and is not managed by this pool"))
		Expect(condition(d, kvv1.ConditionReady).Reason).To(Equal(kvv1.ReasonNameConflict))
		Expect(k8s.Get(ctx, client.ObjectKeyFromObject(foreign), foreign)).To(Succeed())
		Expect(foreign.Subjects).To(ConsistOf(HaveField("Name", "alice")))
		Expect(foreign.OwnerReferences).To(BeEmpty())
		Expect(apierrors.IsNotFound(k8s.Get(ctx, key(ns, "d-router"), &corev1.ServiceAccount{}))).To(BeTrue(), "the set's account was applied")
	})

	It("reports an engine whose pod is not Ready as not ready", func() {
		ns, _, p, _ := readyPair()
		pod := &corev1.Pod{}
		Expect(k8s.Get(ctx, key(ns, "p-0"), pod)).To(Succeed())
		pod.Status.Conditions = []corev1.PodCondition{{Type: corev1.PodReady, Status: corev1.ConditionFalse}}
		Expect(k8s.Status().Update(ctx, pod)).To(Succeed())
		Eventually(func() bool {
			Expect(k8s.Get(ctx, client.ObjectKeyFromObject(p), p)).To(Succeed())
			return len(p.Status.Engines) == 1 && !p.Status.Engines[0].Ready
		}).Should(BeTrue())
	})
})
