// Package peerset is the set of agents an agent may dial: the peer addresses agents
// publish on their nodes (kvhandoff.io/agent-address) while the node is labelled
// kvhandoff.io/agent-ready. An engine names its peer's agent in a request, and a request
// is what a client of the router shapes; checking the address against this set before
// any connection attempt keeps an engine from turning its agent into a relay or a port
// scanner of the node network (a refused port fails at once, an open one hangs: an
// oracle, unless nothing is dialled at all).
package peerset

import (
	"context"
	"fmt"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	listersv1 "k8s.io/client-go/listers/core/v1"
	"k8s.io/client-go/tools/cache"

	"github.com/kvhandoff/kvhandoff/api/v1alpha1"
)

// Set is the published addresses of ready agents, kept current by a watch of nodes.
type Set struct {
	nodes listersv1.NodeLister
}

// Watch starts watching the ready nodes until ctx ends, and returns once the first list
// is in: from then on Check answers from memory.
func Watch(ctx context.Context, c kubernetes.Interface) (*Set, error) {
	f := informers.NewSharedInformerFactoryWithOptions(c, 0, informers.WithTweakListOptions(func(o *metav1.ListOptions) {
		o.LabelSelector = v1alpha1.LabelAgentReady + "=true"
	}))
	nodes := f.Core().V1().Nodes()
	s := &Set{nodes: nodes.Lister()}
	informer := nodes.Informer()
	f.Start(ctx.Done())
	if !cache.WaitForCacheSync(ctx.Done(), informer.HasSynced) {
		return nil, fmt.Errorf("peer set: listing the nodes labelled %s=true: %w", v1alpha1.LabelAgentReady, context.Cause(ctx))
	}
	return s, nil
}

// Check says whether addr is the published address of a ready agent.
func (s *Set) Check(addr string) error {
	nodes, err := s.nodes.List(labels.Everything())
	if err != nil {
		return err
	}
	for _, n := range nodes {
		if published(n) == addr {
			return nil
		}
	}
	return fmt.Errorf("%s is not the address of a ready agent: no node labelled %s=true publishes it in %s", addr,
		v1alpha1.LabelAgentReady, v1alpha1.AnnotationAgentAddress)
}

func published(n *corev1.Node) string { return n.Annotations[v1alpha1.AnnotationAgentAddress] }
