package v1alpha1_test

import (
	"bytes"
	"errors"
	"io"
	"os"
	"path/filepath"

	. "github.com/onsi/ginkgo/v2"
	. "github.com/onsi/gomega"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"

	"github.com/kvhandoff/kvhandoff/test/envtest"
)

// sampleObjects reads every object of every YAML file in config/samples.
func sampleObjects() map[string][]*unstructured.Unstructured {
	files, err := filepath.Glob(filepath.Join(envtest.RepoRoot(), "config", "samples", "*.yaml"))
	Expect(err).NotTo(HaveOccurred())
	out := map[string][]*unstructured.Unstructured{}
	for _, f := range files {
		if filepath.Base(f) == "kustomization.yaml" {
			continue
		}
		data, err := os.ReadFile(f)
		Expect(err).NotTo(HaveOccurred())
		dec := utilyaml.NewYAMLOrJSONDecoder(bytes.NewReader(data), 4096)
		for {
			u := &unstructured.Unstructured{}
			if err := dec.Decode(&u.Object); errors.Is(err, io.EOF) {
				break
			} else {
				Expect(err).NotTo(HaveOccurred(), f)
			}
			if len(u.Object) > 0 {
				out[filepath.Base(f)] = append(out[filepath.Base(f)], u)
			}
		}
	}
	return out
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
