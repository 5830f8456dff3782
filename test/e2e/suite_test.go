// Package e2e is kvhandoff's end-to-end suite. It runs against whatever cluster KUBECONFIG
// names (kind, EKS) with the manager installed there; without KUBECONFIG it brings up the
// simulated cluster of package test/cluster and runs the manager binary locally.
package e2e

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	. "github.com/onsi/ginkgo/v2"
	. "github.com/onsi/gomega"
	"k8s.io/client-go/tools/clientcmd"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/kvhandoff/kvhandoff/internal/controller"
	"github.com/kvhandoff/kvhandoff/test/cluster"
	"github.com/kvhandoff/kvhandoff/test/envtest"
)

var (
	k8s        client.WithWatch
	ctx        = context.Background()
	kubeconfig string
	kubectl    string
	sim        *cluster.Cluster
	managerLog string
	manager    *exec.Cmd
)

func TestE2E(t *testing.T) {
	RegisterFailHandler(Fail)
	RunSpecs(t, "kvhandoff end to end")
}

var _ = BeforeSuite(func() {
	// On real clusters engines load a model before they are ready: KVHANDOFF_E2E_TIMEOUT
	// (a Go duration, say 40m) raises every wait.
	timeout := 2 * time.Minute
	if v := os.Getenv("KVHANDOFF_E2E_TIMEOUT"); v != "" {
		d, err := time.ParseDuration(v)
		Expect(err).NotTo(HaveOccurred(), "KVHANDOFF_E2E_TIMEOUT")
		timeout = d
	}
	SetDefaultEventuallyTimeout(timeout)
	SetDefaultEventuallyPollingInterval(100 * time.Millisecond)
	bins, err := envtest.Binaries("kubectl")
	Expect(err).NotTo(HaveOccurred())
	kubectl = filepath.Join(bins, "kubectl")

	kubeconfig = os.Getenv("KUBECONFIG")
	localManager := os.Getenv("KVHANDOFF_E2E_LOCAL_MANAGER") == "true"
	if kubeconfig == "" {
		By("bringing up the simulated cluster (kube-apiserver, etcd, controller-manager, scheduler, KWOK)")
		dir := GinkgoT().TempDir()
		sim, err = cluster.Start(ctx, cluster.NodesFile(), dir)
		Expect(err).NotTo(HaveOccurred())
		kubeconfig = sim.Kubeconfig
		localManager = true
	}
	cfg, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
	Expect(err).NotTo(HaveOccurred())
	k8s, err = client.NewWithWatch(cfg, client.Options{Scheme: controller.NewScheme()})
	Expect(err).NotTo(HaveOccurred())

	if localManager {
		By("running the manager binary against the cluster")
		bin := filepath.Join(GinkgoT().TempDir(), "manager")
		build := exec.Command("go", "build", "-o", bin, "./cmd/manager")
		build.Dir = envtest.RepoRoot()
		out, err := build.CombinedOutput()
		Expect(err).NotTo(HaveOccurred(), string(out))
		managerLog = filepath.Join(GinkgoT().TempDir(), "manager.log")
		log, err := os.Create(managerLog)
		Expect(err).NotTo(HaveOccurred())
		manager = exec.Command(bin, "--kubeconfig="+kubeconfig, "--metrics-bind-address=0", "--health-probe-bind-address=0")
		manager.Stdout, manager.Stderr = log, log
		Expect(manager.Start()).To(Succeed())
	}
})

var _ = AfterSuite(func() {
	if manager != nil {
		_ = manager.Process.Signal(os.Interrupt)
		_ = manager.Wait()
	}
	if sim != nil {
		Expect(sim.Stop()).To(Succeed())
	}
})
