package v1alpha1_test

import (
	. "github.com/onsi/ginkgo/v2"
	. "github.com/onsi/gomega"
	autoscalingv1 "k8s.io/api/autoscaling/v1"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
	"github.com/kvhandoff/kvhandoff/test/builder"
)

var _ = Describe("The /scale subresource", func() {
	scaleRoundTrip := func(pool client.Object, replicas func() *int32, setStatus func(*kvv1.PoolStatus)) {
		pool.SetNamespace(freshNamespace())
		Expect(k8s.Create(ctx, pool)).To(Succeed())

		By("reading spec.replicas and status.selector through /scale")
		status := kvv1.PoolStatus{Replicas: 2, Selector: "kvhandoff.io/pool=" + pool.GetName()}
		setStatus(&status)
		Expect(k8s.Status().Update(ctx, pool)).To(Succeed())
		scale := &autoscalingv1.Scale{}
		Expect(k8s.SubResource("scale").Get(ctx, pool, scale)).To(Succeed())
		Expect(scale.Spec.Replicas).To(BeEquivalentTo(2))
		Expect(scale.Status.Replicas).To(BeEquivalentTo(2))
		Expect(scale.Status.Selector).To(Equal("kvhandoff.io/pool=" + pool.GetName()))

		By("writing replicas through /scale")
		scale.Spec.Replicas = 5
		Expect(k8s.SubResource("scale").Update(ctx, pool, client.WithSubResourceBody(scale))).To(Succeed())
		Expect(k8s.Get(ctx, client.ObjectKeyFromObject(pool), pool)).To(Succeed())
		Expect(replicas()).To(Equal(ptr.To[int32](5)))
	}

	It("reads and writes a PrefillPool's replicas", func() {
		p := builder.PrefillPool("p").Replicas(2).Obj()
		scaleRoundTrip(p, func() *int32 { return p.Spec.Replicas }, func(s *kvv1.PoolStatus) { p.Status = *s })
	})

	It("reads and writes a DecodePool's replicas", func() {
		d := builder.DecodePool("d", "p").Replicas(2).Obj()
		scaleRoundTrip(d, func() *int32 { return d.Spec.Replicas }, func(s *kvv1.PoolStatus) { d.Status = *s })
	})

	It("refuses a negative replica count through /scale", func() {
		p := builder.PrefillPool("p").Obj()
		p.SetNamespace(freshNamespace())
		Expect(k8s.Create(ctx, p)).To(Succeed())
		scale := &autoscalingv1.Scale{}
		Expect(k8s.SubResource("scale").Get(ctx, p, scale)).To(Succeed())
		scale.Spec.Replicas = -1
		err := k8s.SubResource("scale").Update(ctx, p, client.WithSubResourceBody(scale))
		Expect(err).To(HaveOccurred())
		Expect(err.Error()).To(ContainSubstring("spec.replicas"))
	})
})
