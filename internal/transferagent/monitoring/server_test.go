package monitoring

import (
	"context"
	"crypto/tls"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"path/filepath"
	"strings"
	"testing"
	"time"

	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvhandoff/kvhandoff/internal/controller"
	"github.com/kvhandoff/kvhandoff/test/envtest"
)

// With --metrics-secure, against a real API server and as the agent's own service account
// (config/agent/rbac.yaml must let it ask TokenReview and SubjectAccessReview): /metrics
// answers only the reader role's holder; the probes answer anyone.
func TestSecureMetricsNeedTheReaderRole(t *testing.T) {
	env, err := envtest.Start(controller.NewScheme())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = env.Stop() })
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	admin := kubernetes.NewForConfigOrDie(env.Config)
	if _, err := admin.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "kvhandoff-node"}},
		metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	for _, f := range []string{filepath.Join("agent", "rbac.yaml"), filepath.Join("rbac", "metrics_reader_role.yaml")} {
		objs, err := envtest.ReadObjects(filepath.Join(envtest.RepoRoot(), "config", f))
		if err != nil {
			t.Fatal(err)
		}
		for _, u := range objs {
			if err := env.Client.Create(ctx, u); err != nil {
				t.Fatalf("%s %s: %v", u.GetKind(), u.GetName(), err)
			}
		}
	}
	asAgent := rest.CopyConfig(env.Config)
	asAgent.Impersonate = rest.ImpersonationConfig{
		UserName: "system:serviceaccount:kvhandoff-node:kvhandoff-transfer-agent",
		Groups:   []string{"system:serviceaccounts", "system:serviceaccounts:kvhandoff-node", "system:authenticated"},
	}

	reg := prometheus.NewRegistry()
	transfers := prometheus.NewCounter(prometheus.CounterOpts{Name: "kvhandoff_agent_test_total", Help: "test"})
	reg.MustRegister(transfers)
	addr, err := Start(ctx, Options{
		Addr: "127.0.0.1:0", Gatherer: reg, Secure: true, Kube: asAgent,
		Ready: func() (string, error) { return "", errors.New("no provider yet") },
	}, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}

	// The certificate is self-signed.
	hc := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{InsecureSkipVerify: true}}}
	get := func(path, token string) (int, string) {
		req, _ := http.NewRequest(http.MethodGet, "https://"+addr+path, nil)
		if token != "" {
			req.Header.Set("Authorization", "Bearer "+token)
		}
		resp, err := hc.Do(req)
		if err != nil {
			t.Fatalf("GET %s: %v", path, err)
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(body)
	}
	token := func(name string) string {
		if _, err := admin.CoreV1().ServiceAccounts("default").Create(ctx,
			&corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: name}}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		tr, err := admin.CoreV1().ServiceAccounts("default").CreateToken(ctx, name, &authenticationv1.TokenRequest{}, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		return tr.Status.Token
	}
	if _, err := admin.RbacV1().ClusterRoleBindings().Create(ctx, &rbacv1.ClusterRoleBinding{
		ObjectMeta: metav1.ObjectMeta{Name: "prometheus-reads-kvhandoff"},
		RoleRef:    rbacv1.RoleRef{APIGroup: "rbac.authorization.k8s.io", Kind: "ClusterRole", Name: "kvhandoff-metrics-reader"},
		Subjects:   []rbacv1.Subject{{Kind: "ServiceAccount", Name: "prometheus", Namespace: "default"}},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	reader, stranger := token("prometheus"), token("stranger")

	if code, _ := get("/metrics", ""); code != http.StatusUnauthorized {
		t.Errorf("/metrics without credentials: %d, want 401", code)
	}
	if code, _ := get("/metrics", stranger); code != http.StatusForbidden {
		t.Errorf("/metrics for an authenticated caller without the reader role: %d, want 403", code)
	}
	if code, body := get("/metrics", reader); code != http.StatusOK || !strings.Contains(body, "kvhandoff_agent_test_total") {
		t.Errorf("/metrics for the reader role's holder: %d %q", code, body)
	}
	if code, _ := get("/healthz", ""); code != http.StatusOK {
		t.Errorf("/healthz without credentials: %d, want 200", code)
	}
	if code, body := get("/readyz", ""); code != http.StatusServiceUnavailable || !strings.Contains(body, "no provider yet") {
		t.Errorf("/readyz of an agent that is not ready: %d %q", code, body)
	}
}
