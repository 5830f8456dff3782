package controller

import (
	. "github.com/onsi/ginkgo/v2"
	. "github.com/onsi/gomega"
	"k8s.io/apimachinery/pkg/api/equality"
	"k8s.io/apimachinery/pkg/runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
	"github.com/kvhandoff/kvhandoff/internal/render"
	"github.com/kvhandoff/kvhandoff/test/envtest"
)

// readSample returns the typed objects of a file in config/samples.
func readSample(file string) []client.Object {
	samples, err := envtest.Samples()
	Expect(err).NotTo(HaveOccurred())
	var objs []client.Object
	for _, u := range samples[file] {
		obj, err := env.Scheme.New(u.GroupVersionKind())
		Expect(err).NotTo(HaveOccurred())
		Expect(runtime.DefaultUnstructuredConverter.FromUnstructured(u.Object, obj)).To(Succeed())
		objs = append(objs, obj.(client.Object))
	}
	Expect(objs).NotTo(BeEmpty(), file)
	return objs
}

var _ = Describe("The samples", func() {
	// Every rendering rule has a golden file in package render; this proves that what the
	// API server stores for the samples is exactly what was rendered, field for field.
	DescribeTable("become StatefulSets that hold every rendered field",
		func(file string) {
			ns := freshNamespace()
			var pools []pool
			for _, obj := range readSample(file) {
				create(ns, obj)
				switch o := obj.(type) {
				case *kvv1.PrefillPool, *kvv1.DecodePool:
					pools = append(pools, poolOf(o))
				}
			}
			Expect(pools).To(HaveLen(2))
			for _, p := range pools {
				Expect(k8s.Get(ctx, key(ns, p.GetName()), p.object())).To(Succeed()) // with defaults
				policy := &kvv1.KVTransferPolicy{}
				Expect(k8s.Get(ctx, key(ns, p.engine().TransferPolicyRef.Name), policy)).To(Succeed())
				want, err := render.Engines(render.Input{Role: p.role(), Name: p.GetName(), Namespace: ns, Spec: p.engine(),
					Policy: &policy.Spec, PrefillPool: p.prefillPoolName()})
				Expect(err).NotTo(HaveOccurred())
				live := statefulSet(ns, p.GetName())
				Expect(equality.Semantic.DeepDerivative(want.StatefulSet.Spec, live.Spec)).To(BeTrue(),
					"the live StatefulSet of %s differs from its rendering", p.GetName())
				Expect(live.Annotations).To(HaveKeyWithValue(kvv1.AnnotationRenderedHash, want.StatefulSet.Annotations[kvv1.AnnotationRenderedHash]))
			}
		},
		Entry("P5en push pair", "p5en-push.yaml"),
		Entry("trn2 pull pair", "trn2-pull.yaml"),
	)
})
