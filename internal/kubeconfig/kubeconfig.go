// Package kubeconfig finds the API server for kvhandoff's in-cluster programs (the router
// and the transfer agent): the kubeconfig a flag names, else the pod's service account.
package kubeconfig

import (
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
)

// Load reads the kubeconfig file at path, or the in-cluster configuration when path is "".
func Load(path string) (*rest.Config, error) {
	if path != "" {
		return clientcmd.BuildConfigFromFlags("", path)
	}
	return rest.InClusterConfig()
}
