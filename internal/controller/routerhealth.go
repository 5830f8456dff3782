package controller

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"
	ctrlevent "sigs.k8s.io/controller-runtime/pkg/event"
	"sigs.k8s.io/controller-runtime/pkg/log"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
	"github.com/kvhandoff/kvhandoff/internal/health"
	"github.com/kvhandoff/kvhandoff/internal/render"
)

// routerHealth polls every router pod's health report (GET /health/transfer) and
// enqueues a DecodePool when one of its routers' reports changes. Polling costs no API
// writes, and routers need no permission to write anything: the report reaches the
// DecodePool's status through the manager, its one writer.
type routerHealth struct {
	pods   client.Reader
	every  time.Duration
	client *http.Client
	events chan ctrlevent.GenericEvent

	mu      sync.Mutex
	reports map[types.NamespacedName]routerReport // by router pod
}

// routerReport is one router pod's report and the DecodePool it routes to.
type routerReport struct {
	pool   string
	report health.Report
}

func newRouterHealth(pods client.Reader, every time.Duration) *routerHealth {
	return &routerHealth{
		pods: pods, every: every,
		client:  &http.Client{Timeout: 2 * time.Second},
		events:  make(chan ctrlevent.GenericEvent, 64),
		reports: map[types.NamespacedName]routerReport{},
	}
}

// Start polls until ctx ends (a manager Runnable).
func (h *routerHealth) Start(ctx context.Context) error {
	return every(ctx, h.every, func(ctx context.Context) {
		if err := h.poll(ctx); err != nil {
			log.FromContext(ctx).Error(err, "polling the routers' health reports")
		}
	})
}

// every runs f each period until ctx ends.
func every(ctx context.Context, period time.Duration, f func(context.Context)) error {
	t := time.NewTicker(period)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
			f(ctx)
		}
	}
}

// NeedLeaderElection: only the leader writes status, so only it polls.
func (h *routerHealth) NeedLeaderElection() bool { return true }

// poll reads every router pod's report at once and enqueues the pools whose reports
// changed. A router that does not answer reports nothing: its readiness probe is what
// tells of a router that is down.
func (h *routerHealth) poll(ctx context.Context) error {
	pods := &corev1.PodList{}
	if err := h.pods.List(ctx, pods, client.HasLabels{kvv1.LabelRouter}); err != nil {
		return err
	}
	got := make(map[types.NamespacedName]routerReport, len(pods.Items))
	var mu sync.Mutex
	var wg sync.WaitGroup
	sem := make(chan struct{}, 16)
	for i := range pods.Items {
		pod := &pods.Items[i]
		url := routerHealthURL(pod)
		if url == "" || !routerManaged(ctx, h.pods, pod) {
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			sem <- struct{}{}
			defer func() { <-sem }()
			if r, ok := h.fetch(ctx, url); ok {
				mu.Lock()
				got[client.ObjectKeyFromObject(pod)] = routerReport{pool: pod.Labels[kvv1.LabelRouter], report: r}
				mu.Unlock()
			}
		}()
	}
	wg.Wait()

	h.mu.Lock()
	changed := map[types.NamespacedName]bool{}
	for key, r := range got {
		if old, ok := h.reports[key]; !ok || old.report.Encode() != r.report.Encode() {
			changed[types.NamespacedName{Namespace: key.Namespace, Name: r.pool}] = true
		}
	}
	for key, old := range h.reports {
		if _, ok := got[key]; !ok {
			changed[types.NamespacedName{Namespace: key.Namespace, Name: old.pool}] = true
		}
	}
	h.reports = got
	h.mu.Unlock()
	for pool := range changed {
		d := &kvv1.DecodePool{}
		d.Namespace, d.Name = pool.Namespace, pool.Name
		select {
		case h.events <- ctrlevent.GenericEvent{Object: d}:
		case <-ctx.Done():
			return nil
		}
	}
	return nil
}

func (h *routerHealth) fetch(ctx context.Context, url string) (health.Report, bool) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return health.Report{}, false
	}
	resp, err := h.client.Do(req)
	if err != nil {
		return health.Report{}, false
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 16<<10))
	if err != nil || resp.StatusCode != http.StatusOK {
		return health.Report{}, false
	}
	return health.Parse(string(body))
}

// of returns the reports of a DecodePool's routers, by pod name.
func (h *routerHealth) of(namespace, pool string) map[string]health.Report {
	h.mu.Lock()
	defer h.mu.Unlock()
	out := map[string]health.Report{}
	for key, r := range h.reports {
		if key.Namespace == namespace && r.pool == pool {
			out[key.Name] = r.report
		}
	}
	return out
}

// routerManaged reports whether pod belongs to the router Deployment the manager made for its
// DecodePool: the pod's controller is a ReplicaSet whose controller is that Deployment,
// which the DecodePool controls, each by UID. Anyone who may create pods or ReplicaSets in
// the namespace can copy a router's name and labels; only the manager's own objects carry
// those UIDs.
func routerManaged(ctx context.Context, r client.Reader, pod *corev1.Pod) bool {
	pool := pod.Labels[kvv1.LabelRouter]
	rs := &appsv1.ReplicaSet{}
	dep := &appsv1.Deployment{}
	dp := &kvv1.DecodePool{}
	return controlledBy(ctx, r, pod, rs, "ReplicaSet", "") &&
		controlledBy(ctx, r, rs, dep, "Deployment", render.RouterName(pool)) &&
		controlledBy(ctx, r, dep, dp, "DecodePool", pool)
}

// controlledBy reads obj's controller into owner (of kind, and of name unless "") and
// reports whether it is that very object: same UID.
func controlledBy(ctx context.Context, r client.Reader, obj metav1.Object, owner client.Object, kind, name string) bool {
	ref := metav1.GetControllerOf(obj)
	if ref == nil || ref.Kind != kind || (name != "" && ref.Name != name) {
		return false
	}
	if err := r.Get(ctx, client.ObjectKey{Namespace: obj.GetNamespace(), Name: ref.Name}, owner); err != nil {
		return false
	}
	return owner.GetUID() == ref.UID
}

// routerHealthURL is where a router pod serves its report; "" for a pod that is not one
// of a router Deployment's by name (anyone may label a pod kvhandoff.io/router, and the
// manager must neither poll nor believe it: managed checks the owners themselves) or
// that has no IP yet.
func routerHealthURL(pod *corev1.Pod) string {
	owner := metav1.GetControllerOf(pod)
	if pod.Status.PodIP == "" || pod.DeletionTimestamp != nil || owner == nil || owner.Kind != "ReplicaSet" ||
		!strings.HasPrefix(owner.Name, render.RouterName(pod.Labels[kvv1.LabelRouter])+"-") {
		return ""
	}
	port := int32(render.RouterAdminPort)
	for _, c := range pod.Spec.Containers {
		for _, p := range c.Ports {
			if p.Name == "admin" {
				port = p.ContainerPort
			}
		}
	}
	return fmt.Sprintf("http://%s/health/transfer", net.JoinHostPort(pod.Status.PodIP, strconv.Itoa(int(port))))
}
