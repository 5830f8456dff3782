package v1alpha1_test

import (
	"context"
	"testing"
	"time"

	. "github.com/onsi/ginkgo/v2"
	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/kvhandoff/kvhandoff/internal/controller"
	"github.com/kvhandoff/kvhandoff/test/envtest"
)

// These specs run against a real kube-apiserver and etcd with the generated CRDs
// installed: they prove what the API server does with kvhandoff objects (CEL rules,
// OpenAPI validation, defaults, subresources), not what Go code thinks it does.

var (
	env *envtest.Env
	k8s client.Client
	ctx = context.Background()
)

func TestAPI(t *testing.T) {
	RegisterFailHandler(Fail)
	RunSpecs(t, "kvhandoff.io/v1alpha1 API")
}

var _ = BeforeSuite(func() {
	// Generous on a loaded 2-core CI machine; a passing wait returns as soon as it holds.
	SetDefaultEventuallyTimeout(30 * time.Second)
	SetDefaultEventuallyPollingInterval(20 * time.Millisecond)
	var err error
	env, err = envtest.Start(controller.NewScheme())
	Expect(err).NotTo(HaveOccurred())
	k8s = env.Client
})

var _ = AfterSuite(func() {
	if env != nil {
		Expect(env.Stop()).To(Succeed())
	}
})

// freshNamespace creates a namespace for one spec so specs never see each other's objects.
func freshNamespace() string {
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{GenerateName: "api-"}}
	Expect(k8s.Create(ctx, ns)).To(Succeed())
	return ns.Name
}
