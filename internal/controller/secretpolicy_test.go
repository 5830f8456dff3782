package controller

import (
	"bytes"
	"os"
	"path/filepath"

	. "github.com/onsi/ginkgo/v2"
	. "github.com/onsi/gomega"
	admissionv1 "k8s.io/api/admissionregistration/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/yaml"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
	"github.com/kvhandoff/kvhandoff/test/envtest"
)

// The manager's Secret rights are cluster-wide (a token per PrefillPool, in its
// namespace); config/rbac's admission policy lets it create only the kv-events tokens it
// renders. The attack: a compromised manager creating a service-account token Secret for
// any account, to read it back.
var _ = Describe("The manager's Secret policy", func() {
	It("lets the manager's account create its kv-events tokens and no other Secret", func() {
		b, err := os.ReadFile(filepath.Join(envtest.RepoRoot(), "config", "rbac", "secret_policy.yaml"))
		Expect(err).NotTo(HaveOccurred())
		docs := splitYAML(b)
		policy, binding := &admissionv1.ValidatingAdmissionPolicy{}, &admissionv1.ValidatingAdmissionPolicyBinding{}
		Expect(yaml.UnmarshalStrict(docs[0], policy)).To(Succeed())
		Expect(yaml.UnmarshalStrict(docs[1], binding)).To(Succeed())
		Expect(k8s.Create(ctx, policy)).To(Succeed())
		Expect(k8s.Create(ctx, binding)).To(Succeed())
		DeferCleanup(func() { _ = k8s.Delete(ctx, binding); _ = k8s.Delete(ctx, policy) })

		// The manager's own ClusterRole (config/rbac), bound to its account.
		b, err = os.ReadFile(filepath.Join(envtest.RepoRoot(), "config", "rbac", "role.yaml"))
		Expect(err).NotTo(HaveOccurred())
		role := &rbacv1.ClusterRole{}
		Expect(yaml.Unmarshal(splitYAML(b)[0], role)).To(Succeed())
		Expect(role.Name).To(Equal("kvhandoff-manager"))
		role.Name = "test-kvhandoff-manager-secrets"
		rb := &rbacv1.ClusterRoleBinding{ObjectMeta: metav1.ObjectMeta{Name: role.Name},
			RoleRef:  rbacv1.RoleRef{APIGroup: "rbac.authorization.k8s.io", Kind: "ClusterRole", Name: role.Name},
			Subjects: []rbacv1.Subject{{Kind: "ServiceAccount", Name: "kvhandoff-manager", Namespace: "kvhandoff-system"}}}
		Expect(k8s.Create(ctx, role)).To(Succeed())
		Expect(k8s.Create(ctx, rb)).To(Succeed())
		DeferCleanup(func() { _ = k8s.Delete(ctx, rb); _ = k8s.Delete(ctx, role) })

		cfg := rest.CopyConfig(env.Config)
		cfg.Impersonate = rest.ImpersonationConfig{UserName: "system:serviceaccount:kvhandoff-system:kvhandoff-manager"}
		manager, err := client.New(cfg, client.Options{Scheme: env.Scheme})
		Expect(err).NotTo(HaveOccurred())
		ns := freshNamespace()
		prefill := &kvv1.PrefillPool{ObjectMeta: metav1.ObjectMeta{Name: "p", Namespace: ns, UID: "u-1"}}

		minted := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "admin-token", Namespace: ns,
			Annotations: map[string]string{corev1.ServiceAccountNameKey: "default"}}, Type: corev1.SecretTypeServiceAccountToken}
		// The policy takes effect once the API server has compiled it.
		Eventually(func() string {
			err := manager.Create(ctx, minted.DeepCopy())
			if err == nil {
				Expect(k8s.Delete(ctx, minted)).To(Succeed())
				return ""
			}
			return err.Error()
		}).Should(ContainSubstring("the kvhandoff manager creates only its PrefillPools' kv-events token Secrets"))

		forged := kvEventsTokenSecret(types.NamespacedName{Namespace: ns, Name: "p-kv-events"}, prefill)
		forged.Data["extra"] = []byte("x")
		Expect(manager.Create(ctx, forged)).To(MatchError(ContainSubstring("creates only")))
		renamed := kvEventsTokenSecret(types.NamespacedName{Namespace: ns, Name: "p-other"}, prefill)
		Expect(manager.Create(ctx, renamed)).To(MatchError(ContainSubstring("creates only")))
		// The token as the manager renders it passes.
		Expect(manager.Create(ctx, kvEventsTokenSecret(types.NamespacedName{Namespace: ns, Name: "p-kv-events"}, prefill))).To(Succeed())
	})
})

// splitYAML splits a multi-document YAML file.
func splitYAML(b []byte) [][]byte {
	var docs [][]byte
	for _, d := range bytes.Split(b, []byte("---\n")) {
		if len(bytes.TrimSpace(d)) > 0 {
			docs = append(docs, d)
		}
	}
	return docs
}
