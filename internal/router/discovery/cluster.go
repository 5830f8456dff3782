package discovery

import (
	"context"

	"fmt"
	"log/slog"
	"net"
	"reflect"
	"strconv"

	"github.com/go-logr/logr"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/selection"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/rest"
	toolscache "k8s.io/client-go/tools/cache"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
	"github.com/kvhandoff/kvhandoff/internal/informer"
)

// HTTPPort is the port engines serve vLLM's OpenAI API on (the manager renders it).
const HTTPPort = 8000

// Cluster is a Source that follows one DecodePool and its PrefillPool: their status
// names the engines (identity, side channel, sizes, compat-hash, read by the manager
// from the pods), and the pods themselves say, as soon as the kubelet does, whether an
// engine is Ready. It watches only its namespace, and only engine pods.
type Cluster struct {
	Config     *rest.Config
	Namespace  string
	DecodePool string
	Log        *slog.Logger
}

// Run watches until ctx ends, sending a new Set whenever the eligible engines change.
func (c *Cluster) Run(ctx context.Context, out chan<- *Set) error {
	log := c.Log
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	scheme := runtime.NewScheme()
	if err := clientgoscheme.AddToScheme(scheme); err != nil {
		return err
	}
	if err := kvv1.AddToScheme(scheme); err != nil {
		return err
	}
	// Router pods carry the pool label too; only engines carry the role label.
	engines, err := labels.NewRequirement(kvv1.LabelRole, selection.Exists, nil)
	if err != nil {
		return err
	}
	cc, err := cache.New(c.Config, cache.Options{
		Scheme:            scheme,
		DefaultNamespaces: map[string]cache.Config{c.Namespace: {}},
		ByObject:          map[client.Object]cache.ByObject{&corev1.Pod{}: {Label: labels.NewSelector().Add(*engines)}},
		// Back within a second or two of an API-server outage: engines that restarted
		// or went meanwhile are seen then, not after client-go's back-off.
		NewInformer: informer.New(logr.FromSlogHandler(log.Handler())),
	})
	if err != nil {
		return err
	}
	poke := make(chan struct{}, 1)
	handler := toolscache.ResourceEventHandlerFuncs{
		AddFunc:    func(any) { nudge(poke) },
		UpdateFunc: func(any, any) { nudge(poke) },
		DeleteFunc: func(any) { nudge(poke) },
	}
	for _, obj := range []client.Object{&kvv1.DecodePool{}, &kvv1.PrefillPool{}, &corev1.Pod{}} {
		inf, err := cc.GetInformer(ctx, obj)
		if err != nil {
			return err
		}
		if _, err := inf.AddEventHandler(handler); err != nil {
			return err
		}
	}
	errc := make(chan error, 1)
	go func() { errc <- cc.Start(ctx) }()
	if !cc.WaitForCacheSync(ctx) {
		return fmt.Errorf("syncing the cache of namespace %s", c.Namespace)
	}
	var last *Set
	for {
		select {
		case <-ctx.Done():
			return nil
		case err := <-errc:
			return err
		case <-poke:
		}
		s, err := c.read(ctx, cc)
		if err != nil {
			log.Error("reading the pools", "namespace", c.Namespace, "decodePool", c.DecodePool, "err", err)
			continue
		}
		if s == nil || (last != nil && reflect.DeepEqual(s, last)) {
			continue
		}
		last = s
		select {
		case out <- s:
		case <-ctx.Done():
			return nil
		}
	}
}

func nudge(c chan struct{}) {
	select {
	case c <- struct{}{}:
	default:
	}
}

// read builds the Set from the cache; nil until the manager has published the mode.
func (c *Cluster) read(ctx context.Context, r client.Reader) (*Set, error) {
	src := c.Namespace + "/" + c.DecodePool
	d := &kvv1.DecodePool{}
	err := r.Get(ctx, client.ObjectKey{Namespace: c.Namespace, Name: c.DecodePool}, d)
	if apierrors.IsNotFound(err) {
		// The pool is gone: route nothing.
		return &Set{Mode: kvv1.TransferPull, Source: src + " (not found)"}, nil
	}
	if err != nil {
		return nil, err
	}
	if d.Status.Mode == "" {
		return nil, nil
	}
	s := &Set{Mode: d.Status.Mode, HandoffFailurePolicy: d.Status.HandoffFailurePolicy,
		HandoffFailureLimitPercent: &d.Status.HandoffFailureLimitPercent, HealthWindowSeconds: d.Status.HealthWindowSeconds, Routing: d.Status.Routing, BlockSize: int(d.Spec.BlockSize), Source: fmt.Sprintf("DecodePool %s, PrefillPool %s", src, d.Spec.PrefillPoolRef.Name)}
	pods := &corev1.PodList{}
	if err := r.List(ctx, pods, client.InNamespace(c.Namespace)); err != nil {
		return nil, err
	}
	byName := map[string]*corev1.Pod{}
	for i := range pods.Items {
		byName[pods.Items[i].Name] = &pods.Items[i]
	}
	s.Decode = eligible(d.Status.Engines, byName, false)
	p := &kvv1.PrefillPool{}
	err = r.Get(ctx, client.ObjectKey{Namespace: c.Namespace, Name: d.Spec.PrefillPoolRef.Name}, p)
	switch {
	case apierrors.IsNotFound(err):
	case err != nil:
		return nil, err
	default:
		s.Prefill = eligible(p.Status.Engines, byName, s.Mode == kvv1.TransferPush)
	}
	return s, nil
}

// eligible are the engines the status names whose pods are Ready now, not being deleted,
// and still at the status's address. A push prefill engine also needs its side channel
// and TP size, which a push decode leg names.
func eligible(engines []kvv1.EngineStatus, pods map[string]*corev1.Pod, push bool) []Engine {
	var out []Engine
	for _, e := range engines {
		pod := pods[e.PodName]
		if pod == nil || pod.DeletionTimestamp != nil || pod.Status.PodIP == "" || pod.Status.PodIP != e.Host || !ready(pod) {
			continue
		}
		host, port := e.Host, e.SideChannelPort
		if e.Agent != "" {
			// Executor Agent: the engine's KV side channel is its node's transfer agent,
			// which a push decode leg must name.
			h, p, err := net.SplitHostPort(e.Agent)
			n, perr := strconv.ParseInt(p, 10, 32)
			if err != nil || perr != nil {
				continue
			}
			host, port = h, int32(n)
		}
		if push && (port <= 0 || e.TensorParallelSize <= 0) {
			continue
		}
		var events string
		if port, err := strconv.ParseUint(pod.Labels[kvv1.LabelKVEventsPort], 10, 16); err == nil && port > 0 {
			// The pod runs the kv-events sidecar (this one: a rollout mixes pods with and without).
			events = "http://" + net.JoinHostPort(pod.Status.PodIP, strconv.FormatUint(port, 10))
		}
		out = append(out, Engine{
			URL: EngineURL(pod.Status.PodIP), KVEventsURL: events,
			EngineID: e.EngineID, Host: host, SideChannelPort: port,
			TensorParallelSize: e.TensorParallelSize, PipelineParallelSize: e.PipelineParallelSize,
			// The pod's own label is what it runs; the status copy can lag a rollout.
			CompatHash: pod.Labels[kvv1.LabelCompatHash],
		})
	}
	return out
}

func ready(pod *corev1.Pod) bool {
	for _, c := range pod.Status.Conditions {
		if c.Type == corev1.PodReady {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}

// EngineURL is the OpenAI API of the engine whose pod has IP ip.
func EngineURL(ip string) string { return "http://" + net.JoinHostPort(ip, strconv.Itoa(HTTPPort)) }
