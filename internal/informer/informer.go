// Package informer builds the shared informers through which the manager and the routers
// watch the API server, so that after an API-server outage they see the cluster again
// within a second or two of its return.
//
// client-go's reflector backs off between tries while the API server refuses its
// connections: 0.8 s doubling to 30 s, each wait stretched by up to as much again at
// random, and reset only after two quiet minutes. After a 30 s outage its next try may be
// a minute away, and until then a controller reads a cache that no longer matches the
// cluster: an engine that restarted meanwhile is never reported. Here the list and the
// watch retry a refused or reset connection themselves, every Retry, so the reflector
// never sees the outage, and its back-off is kept for what it is for (an API server that
// answers 429, or that answers with errors).
//
// One informer per kind per manager or router replica retries this way: a handful of
// clients. The node agents, one per node, keep client-go's back-off: a fleet of them
// reconnecting within the same second is the storm it exists to prevent.
package informer

import (
	"context"
	"math/rand/v2"
	"time"

	"github.com/go-logr/logr"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	utilnet "k8s.io/apimachinery/pkg/util/net"
	"k8s.io/apimachinery/pkg/watch"
	toolscache "k8s.io/client-go/tools/cache"
)

// Retry is how often a list or watch tries again while the API server refuses its
// connections (stretched by up to a half at random, so replicas spread out).
const Retry = time.Second

// New returns a constructor of shared informers for controller-runtime's
// cache.Options.NewInformer, whose lists and watches retry a refused or reset connection
// every Retry; log says when the API server went away and when it came back.
func New(log logr.Logger) func(toolscache.ListerWatcher, runtime.Object, time.Duration, toolscache.Indexers) toolscache.SharedIndexInformer {
	return func(lw toolscache.ListerWatcher, obj runtime.Object, resync time.Duration, idx toolscache.Indexers) toolscache.SharedIndexInformer {
		return toolscache.NewSharedIndexInformer(Retrying(lw, log, Retry), obj, resync, idx)
	}
}

// Retrying wraps lw: its ListWithContext and WatchWithContext, which the reflector calls,
// retry a refused or reset connection every (jittered) until they succeed, fail
// otherwise, or their context ends. List and Watch, which it does not call, are lw's.
func Retrying(lw toolscache.ListerWatcher, log logr.Logger, every time.Duration) toolscache.ListerWatcher {
	return &retrying{ListerWatcher: lw, lw: toolscache.ToListerWatcherWithContext(lw), log: log, every: every}
}

type retrying struct {
	toolscache.ListerWatcher
	lw    toolscache.ListerWatcherWithContext
	log   logr.Logger
	every time.Duration
}

func (r *retrying) ListWithContext(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
	return retry(ctx, r, "list", func() (runtime.Object, error) { return r.lw.ListWithContext(ctx, o) })
}

func (r *retrying) WatchWithContext(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
	return retry(ctx, r, "watch", func() (watch.Interface, error) { return r.lw.WatchWithContext(ctx, o) })
}

// remind is how often a call still failing says so again.
const remind = time.Minute

func retry[T any](ctx context.Context, r *retrying, what string, call func() (T, error)) (T, error) {
	var since, said time.Time
	for {
		v, err := call()
		if !unreachable(err) {
			if !since.IsZero() {
				r.log.Info("the API server is back", "call", what, "after", time.Since(since).Round(time.Millisecond).String())
			}
			return v, err
		}
		switch {
		case since.IsZero():
			since, said = time.Now(), time.Now()
			r.log.Info("the API server is unreachable; trying again every "+r.every.String()+" to "+(r.every*3/2).String(), "call", what, "err", err.Error())
		case time.Since(said) >= remind:
			said = time.Now()
			r.log.Info("the API server is still unreachable", "call", what, "for", time.Since(since).Round(time.Second).String(), "err", err.Error())
		}
		t := time.NewTimer(r.every + rand.N(r.every/2+1))
		select {
		case <-ctx.Done():
			t.Stop()
			return v, err
		case <-t.C:
		}
	}
}

// unreachable says whether err is the API server's absence rather than its answer:
// nothing listens (it is down or restarting), or the connection was reset under the call.
func unreachable(err error) bool {
	return err != nil && (utilnet.IsConnectionRefused(err) || utilnet.IsConnectionReset(err))
}
