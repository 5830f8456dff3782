package controller

import (
	"context"
	"crypto/tls"
	"net"
	"net/http"
	"os"
	"path/filepath"

	. "github.com/onsi/ginkgo/v2"
	. "github.com/onsi/gomega"
	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/yaml"

	"github.com/kvhandoff/kvhandoff/test/envtest"
	"github.com/kvhandoff/kvhandoff/test/loopback"
)

var _ = Describe("Metrics", func() {
	It("serves /metrics only to callers the API server authenticates and authorizes", func() {
		addr := net.JoinHostPort(loopback.New(GinkgoT()), "8443")
		mgr, err := ctrl.NewManager(env.Config, ctrl.Options{Scheme: env.Scheme, Metrics: MetricsOptions(addr, true), HealthProbeBindAddress: "0"})
		Expect(err).NotTo(HaveOccurred())
		mctx, stop := context.WithCancel(ctx)
		DeferCleanup(stop)
		go func() { _ = mgr.Start(mctx) }()

		get := func(token string) int {
			req, _ := http.NewRequest(http.MethodGet, "https://"+addr+"/metrics", nil)
			if token != "" {
				req.Header.Set("Authorization", "Bearer "+token)
			}
			// The manager's serving certificate is self-signed.
			c := &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{InsecureSkipVerify: true}}}
			resp, err := c.Do(req)
			if err != nil {
				return 0
			}
			resp.Body.Close()
			return resp.StatusCode
		}
		Eventually(func() int { return get("") }).Should(Equal(http.StatusUnauthorized), "a caller without credentials")

		// Service accounts' tokens: both authenticate; only the one bound to config/rbac's
		// reader role may read. (The filter caches denials for a while, so each token is
		// asked once its bindings are in place.)
		ns := freshNamespace()
		cs := kubernetes.NewForConfigOrDie(env.Config)
		token := func(name string) string {
			_, err := cs.CoreV1().ServiceAccounts(ns).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: name}}, metav1.CreateOptions{})
			Expect(err).NotTo(HaveOccurred())
			tr, err := cs.CoreV1().ServiceAccounts(ns).CreateToken(ctx, name, &authenticationv1.TokenRequest{}, metav1.CreateOptions{})
			Expect(err).NotTo(HaveOccurred())
			return tr.Status.Token
		}
		data, err := os.ReadFile(filepath.Join(envtest.RepoRoot(), "config", "rbac", "metrics_reader_role.yaml"))
		Expect(err).NotTo(HaveOccurred())
		role := &rbacv1.ClusterRole{}
		Expect(yaml.Unmarshal(data, role)).To(Succeed())
		Expect(k8s.Create(ctx, role)).To(Succeed())
		Expect(k8s.Create(ctx, &rbacv1.ClusterRoleBinding{
			ObjectMeta: metav1.ObjectMeta{Name: "prometheus-reads-kvhandoff"},
			RoleRef:    rbacv1.RoleRef{APIGroup: "rbac.authorization.k8s.io", Kind: "ClusterRole", Name: role.Name},
			Subjects:   []rbacv1.Subject{{Kind: "ServiceAccount", Name: "prometheus", Namespace: ns}},
		})).To(Succeed())
		reader, stranger := token("prometheus"), token("stranger")
		Eventually(func() int { return get(reader) }).Should(Equal(http.StatusOK), "the reader role's holder")
		Expect(get(stranger)).To(Equal(http.StatusForbidden), "an authenticated caller without the reader role")
	})
})
