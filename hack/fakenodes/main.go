// Command fakenodes creates the simulated accelerator nodes of test/cluster/nodes.yaml in
// the cluster KUBECONFIG names, for a KWOK controller running there to manage (see
// hack/kind). It is how a kind cluster gets the same p5en and trn2 nodes as the simulated one.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/kvhandoff/kvhandoff/internal/controller"
	"github.com/kvhandoff/kvhandoff/test/cluster"
)

func main() {
	nodes := flag.String("nodes", cluster.NodesFile(), "the simulated nodes' description")
	flag.Parse()
	if err := run(*nodes); err != nil {
		fmt.Fprintln(os.Stderr, "fakenodes:", err)
		os.Exit(1)
	}
}

func run(path string) error {
	cfg, err := ctrl.GetConfig()
	if err != nil {
		return err
	}
	c, err := client.New(cfg, client.Options{Scheme: controller.NewScheme()})
	if err != nil {
		return err
	}
	nodes, err := cluster.Nodes(path)
	if err != nil {
		return err
	}
	for _, n := range nodes {
		err := c.Create(context.Background(), n)
		switch {
		case apierrors.IsAlreadyExists(err):
			fmt.Printf("node/%s exists\n", n.Name)
		case err != nil:
			return fmt.Errorf("creating node %s: %w", n.Name, err)
		default:
			fmt.Printf("node/%s created (%s, %s)\n", n.Name, n.Labels["node.kubernetes.io/instance-type"], n.Labels["topology.kubernetes.io/zone"])
		}
	}
	// The DRA nodes' ResourceSlices and DeviceClasses, as their drivers would publish them.
	dir, err := os.MkdirTemp("", "fakenodes-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	if err := cluster.PublishDevices(context.Background(), c, path, dir); err != nil {
		// A cluster before Kubernetes 1.34 serves no resource.k8s.io/v1: its DRA nodes
		// have no devices, and the e2e suite's DRA specs fail there, saying so.
		fmt.Fprintln(os.Stderr, "fakenodes: the DRA nodes' devices were not published:", err)
	}
	return nil
}
