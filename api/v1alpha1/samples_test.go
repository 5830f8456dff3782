package v1alpha1_test

import (
	. "github.com/onsi/ginkgo/v2"
	. "github.com/onsi/gomega"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"

	"github.com/kvhandoff/kvhandoff/test/envtest"
)

func sampleObjects() map[string][]*unstructured.Unstructured {
	samples, err := envtest.Samples()
	Expect(err).NotTo(HaveOccurred())
	return samples
}

var _ = Describe("Samples", func() {
	It("has the P5en push pair and the trn2 pull pair", func() {
		samples := sampleObjects()
		Expect(samples).To(HaveKey("p5en-push.yaml"))
		Expect(samples).To(HaveKey("trn2-pull.yaml"))
		for file, objs := range samples {
			kinds := []string{}
			for _, o := range objs {
				kinds = append(kinds, o.GetKind())
			}
			Expect(kinds).To(ConsistOf("KVTransferPolicy", "PrefillPool", "DecodePool"), file)
		}
	})

	It("accepts every sample with strict field validation", func() {
		for file, objs := range sampleObjects() {
			ns := freshNamespace()
			for _, o := range objs {
				o.SetNamespace(ns)
				Expect(k8s.Create(ctx, o)).To(Succeed(), "%s: %s %s", file, o.GetKind(), o.GetName())
			}
		}
	})
})
