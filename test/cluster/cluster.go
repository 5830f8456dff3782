// Package cluster runs a simulated Kubernetes cluster on loopback for the end-to-end suite
// and the demo: a real kube-apiserver, etcd, kube-controller-manager and kube-scheduler
// (built from Go modules by hack/control-plane-bins.sh) and KWOK, which plays the kubelet
// of fake accelerator nodes. Real scheduling, real controllers, no containers.
package cluster

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"sigs.k8s.io/controller-runtime/pkg/client"
	ctrlenvtest "sigs.k8s.io/controller-runtime/pkg/envtest"

	"github.com/kvhandoff/kvhandoff/internal/controller"
	"github.com/kvhandoff/kvhandoff/test/envtest"
)

// NodesFile is the checked-in description of the simulated nodes.
func NodesFile() string { return filepath.Join(envtest.RepoRoot(), "test", "cluster", "nodes.yaml") }

// Cluster is a running simulated cluster.
type Cluster struct {
	// Kubeconfig is the path of an admin kubeconfig for the cluster.
	Kubeconfig string
	// LogDir holds one log file per process.
	LogDir string
	// Client is an admin client.
	Client client.Client

	env   *envtest.Env
	procs []*exec.Cmd
}

// Start starts the cluster, creates the nodes of nodesFile and waits until they are Ready.
// Logs go to logDir. On error, whatever started is stopped.
func Start(ctx context.Context, nodesFile, logDir string) (c *Cluster, err error) {
	nodes, shapes, err := nodesAndShapes(nodesFile)
	if err != nil {
		return nil, err
	}
	bins, err := envtest.Binaries("kube-apiserver", "etcd", "kube-controller-manager", "kube-scheduler", "kwok")
	if err != nil {
		return nil, err
	}
	c = &Cluster{LogDir: logDir}
	defer func() {
		if err != nil {
			_ = c.Stop()
		}
	}()
	if c.env, err = envtest.Start(controller.NewScheme()); err != nil {
		return nil, err
	}
	c.Client = c.env.Client
	admin, err := c.env.ControlPlane.AddUser(ctrlenvtest.User{Name: "kvhandoff-admin", Groups: []string{"system:masters"}}, nil)
	if err != nil {
		return nil, err
	}
	kubeconfig, err := admin.KubeConfig()
	if err != nil {
		return nil, err
	}
	c.Kubeconfig = filepath.Join(logDir, "kubeconfig")
	if err := os.WriteFile(c.Kubeconfig, kubeconfig, 0o600); err != nil {
		return nil, err
	}

	// The token controller needs the service-account signing key, which the test API
	// server keeps to itself; pods here run no code that would use a token.
	if err := c.run("kube-controller-manager", filepath.Join(bins, "kube-controller-manager"),
		"--kubeconfig="+c.Kubeconfig, "--controllers=*,-serviceaccount-token",
		"--secure-port=0", "--leader-elect=false", "--cluster-name=kvhandoff-sim"); err != nil {
		return nil, err
	}
	if err := c.run("kube-scheduler", filepath.Join(bins, "kube-scheduler"),
		"--kubeconfig="+c.Kubeconfig, "--secure-port=0", "--leader-elect=false"); err != nil {
		return nil, err
	}
	if err := c.run("kwok", filepath.Join(bins, "kwok"),
		"--kubeconfig="+c.Kubeconfig, "--config="+filepath.Join(bins, "kwok-stages.yaml"),
		"--manage-all-nodes=false", "--manage-nodes-with-annotation-selector="+kwokNodeAnnotation+"=fake",
		"--cidr=198.18.0.0/16", "--node-ip=198.19.0.1"); err != nil {
		return nil, err
	}
	for _, n := range nodes {
		if err := c.Client.Create(ctx, n); err != nil {
			return nil, fmt.Errorf("creating node %s: %w", n.Name, err)
		}
	}
	if err := c.waitNodesReady(ctx, len(nodes)); err != nil {
		return nil, fmt.Errorf("%w\n%s", err, c.LogTail(20))
	}
	if err := publishDevices(ctx, c.Client, nodes, shapes, filepath.Join(logDir, "fixtures")); err != nil {
		return nil, err
	}
	return c, nil
}

// run starts a process of the cluster with its output in LogDir/name.log.
func (c *Cluster) run(name, bin string, args ...string) error {
	log, err := os.Create(filepath.Join(c.LogDir, name+".log"))
	if err != nil {
		return err
	}
	cmd := exec.Command(bin, args...)
	cmd.Stdout, cmd.Stderr = log, log
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGTERM}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("starting %s: %w", name, err)
	}
	c.procs = append(c.procs, cmd)
	return nil
}

func (c *Cluster) waitNodesReady(ctx context.Context, want int) error {
	err := wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, 2*time.Minute, true, func(ctx context.Context) (bool, error) {
		for _, p := range c.procs {
			if p.ProcessState != nil {
				return false, fmt.Errorf("%s exited", filepath.Base(p.Path))
			}
		}
		list := &corev1.NodeList{}
		if err := c.Client.List(ctx, list); err != nil {
			return false, nil
		}
		ready := 0
		for _, n := range list.Items {
			for _, cond := range n.Status.Conditions {
				if cond.Type == corev1.NodeReady && cond.Status == corev1.ConditionTrue {
					ready++
				}
			}
		}
		return ready == want, nil
	})
	if err != nil {
		return fmt.Errorf("waiting for %d simulated nodes to become Ready: %w", want, err)
	}
	return nil
}

// LogTail returns the last lines of every process's log, for failure reports.
func (c *Cluster) LogTail(lines int) string {
	files, _ := filepath.Glob(filepath.Join(c.LogDir, "*.log"))
	return TailFiles(files, lines)
}

// TailFiles returns the last lines of each file, headed by its name.
func TailFiles(files []string, lines int) string {
	var b strings.Builder
	for _, f := range files {
		data, err := os.ReadFile(f)
		if err != nil {
			continue
		}
		all := strings.Split(strings.TrimRight(string(data), "\n"), "\n")
		if len(all) > lines {
			all = all[len(all)-lines:]
		}
		fmt.Fprintf(&b, "==> %s (last %d lines)\n%s\n", f, len(all), strings.Join(all, "\n"))
	}
	return b.String()
}

// Stop stops the processes, then the API server and etcd.
func (c *Cluster) Stop() error {
	var errs []error
	for i := len(c.procs) - 1; i >= 0; i-- {
		p := c.procs[i]
		_ = syscall.Kill(-p.Process.Pid, syscall.SIGTERM)
		done := make(chan error, 1)
		go func() { done <- p.Wait() }()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			_ = syscall.Kill(-p.Process.Pid, syscall.SIGKILL)
			<-done
		}
	}
	if c.env != nil {
		errs = append(errs, c.env.Stop())
	}
	return errors.Join(errs...)
}
