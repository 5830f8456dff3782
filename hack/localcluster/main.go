// Command localcluster runs a loopback-only control plane for make demo and
// make e2e-cluster-up: kube-apiserver and etcd with kvhandoff's CRDs, and with
// --simulated also kube-controller-manager, kube-scheduler and KWOK with the simulated
// accelerator nodes of test/cluster/nodes.yaml. It writes an admin kubeconfig and serves
// until it is interrupted.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"

	"github.com/kvhandoff/kvhandoff/test/cluster"
)

func main() {
	kubeconfig := flag.String("write-kubeconfig", "", "path to write the admin kubeconfig to (required)")
	logDir := flag.String("log-dir", "", "folder for the processes' logs (default: a new temporary folder)")
	nodes := flag.String("nodes", cluster.NodesFile(), "the simulated nodes' description")
	flag.Parse()
	if *kubeconfig == "" {
		fmt.Fprintln(os.Stderr, "localcluster: --write-kubeconfig is required")
		os.Exit(2)
	}
	if err := run(*kubeconfig, *logDir, *nodes); err != nil {
		fmt.Fprintln(os.Stderr, "localcluster:", err)
		os.Exit(1)
	}
}

func run(kubeconfig, logDir, nodes string) error {
	if logDir == "" {
		var err error
		if logDir, err = os.MkdirTemp("", "kvhandoff-cluster-"); err != nil {
			return err
		}
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	c, err := cluster.Start(ctx, nodes, logDir)
	if err != nil {
		return err
	}
	defer func() {
		if err := c.Stop(); err != nil {
			fmt.Fprintln(os.Stderr, "localcluster: stopping:", err)
		}
	}()
	// Copy, then rename, so a reader that waits for the file never sees half of it.
	data, err := os.ReadFile(c.Kubeconfig)
	if err != nil {
		return err
	}
	if err := os.WriteFile(kubeconfig+".tmp", data, 0o600); err != nil {
		return err
	}
	if err := os.Rename(kubeconfig+".tmp", kubeconfig); err != nil {
		return err
	}
	fmt.Printf("simulated cluster up: kubeconfig %s, logs in %s\n", kubeconfig, filepath.Clean(logDir))
	<-ctx.Done()
	return nil
}
