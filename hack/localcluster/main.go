// Command localcluster runs a loopback-only kube-apiserver and etcd (the binaries
// hack/control-plane-bins.sh builds), installs kvhandoff's CRDs, writes an admin
// kubeconfig and serves until it is interrupted. make demo uses it.
package main

import (
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"sigs.k8s.io/controller-runtime/pkg/envtest"

	"github.com/kvhandoff/kvhandoff/controllers"
	kvenvtest "github.com/kvhandoff/kvhandoff/test/envtest"
)

func main() {
	kubeconfig := flag.String("write-kubeconfig", "", "path to write the admin kubeconfig to (required)")
	flag.Parse()
	if *kubeconfig == "" {
		fmt.Fprintln(os.Stderr, "localcluster: --write-kubeconfig is required")
		os.Exit(2)
	}
	if err := run(*kubeconfig); err != nil {
		fmt.Fprintln(os.Stderr, "localcluster:", err)
		os.Exit(1)
	}
}

func run(kubeconfig string) error {
	env, err := kvenvtest.Start(controllers.NewScheme())
	if err != nil {
		return err
	}
	defer func() {
		if err := env.Stop(); err != nil {
			fmt.Fprintln(os.Stderr, "localcluster: stopping:", err)
		}
	}()

	admin, err := env.ControlPlane.AddUser(envtest.User{Name: "kvhandoff-admin", Groups: []string{"system:masters"}}, nil)
	if err != nil {
		return fmt.Errorf("adding the admin user: %w", err)
	}
	data, err := admin.KubeConfig()
	if err != nil {
		return err
	}
	// Write then rename, so a reader that waits for the file never sees half of it.
	if err := os.WriteFile(kubeconfig+".tmp", data, 0o600); err != nil {
		return err
	}
	if err := os.Rename(kubeconfig+".tmp", kubeconfig); err != nil {
		return err
	}
	fmt.Printf("kube-apiserver serving at %s; kubeconfig %s\n", env.Config.Host, kubeconfig)

	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGINT, syscall.SIGTERM)
	<-stop
	return nil
}
