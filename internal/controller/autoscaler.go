package controller

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/events"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/log"
	"sigs.k8s.io/controller-runtime/pkg/metrics"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
	"github.com/kvhandoff/kvhandoff/internal/autoscale"
	"github.com/kvhandoff/kvhandoff/internal/load"
	"github.com/kvhandoff/kvhandoff/internal/render"
)

// autoscaler sizes every DecodePool with spec.autoscaling and its PrefillPool. Each tick
// it reads the load reports of the pool's routers (and leg runners, behind a gateway),
// decides (package autoscale), and writes the sizes into the DecodePool's
// status.autoscaling, from which both pools' reconcilers render their StatefulSets. What
// it learns of the engines (their prefill rate, token gaps under load) lives in memory:
// a new leader learns it again, holding the sizes until it has.
type autoscaler struct {
	client   client.Client
	recorder events.EventRecorder
	every    time.Duration
	http     *http.Client

	mu    sync.Mutex
	pairs map[types.NamespacedName]*pairState
}

// pairState is what the autoscaler keeps of one DecodePool between ticks.
type pairState struct {
	series  map[string]*autoscale.Series // by pod name
	learned autoscale.State
}

func newAutoscaler(c client.Client, recorder events.EventRecorder, every time.Duration) *autoscaler {
	return &autoscaler{client: c, recorder: recorder, every: every, http: &http.Client{Timeout: 2 * time.Second},
		pairs: map[types.NamespacedName]*pairState{}}
}

// Start decides every `every` until ctx ends (a manager Runnable).
func (a *autoscaler) Start(ctx context.Context) error { return every(ctx, a.every, a.tick) }

// NeedLeaderElection: only the leader writes status, so only it decides.
func (a *autoscaler) NeedLeaderElection() bool { return true }

func (a *autoscaler) tick(ctx context.Context) {
	pools := &kvv1.DecodePoolList{}
	if err := a.client.List(ctx, pools); err != nil {
		log.FromContext(ctx).Error(err, "listing DecodePools to autoscale")
		return
	}
	seen := map[types.NamespacedName]bool{}
	for i := range pools.Items {
		dp := &pools.Items[i]
		if dp.Spec.Autoscaling == nil || dp.DeletionTimestamp != nil {
			continue
		}
		key := client.ObjectKeyFromObject(dp)
		seen[key] = true
		if err := a.scale(ctx, dp); err != nil && !apierrors.IsConflict(err) {
			log.FromContext(ctx).Error(err, "autoscaling", "decodePool", key)
		}
	}
	a.mu.Lock()
	for key := range a.pairs {
		if !seen[key] {
			delete(a.pairs, key)
			forgetAutoscalerMetrics(key.Namespace, key.Name)
		}
	}
	a.mu.Unlock()
}

// scale makes one decision for a pair: measure → decide → step within the budget → status.
func (a *autoscaler) scale(ctx context.Context, dp *kvv1.DecodePool) error {
	spec := dp.Spec.Autoscaling
	pp := &kvv1.PrefillPool{}
	if err := a.client.Get(ctx, types.NamespacedName{Namespace: dp.Namespace, Name: dp.Spec.PrefillPoolRef.Name}, pp); err != nil {
		return client.IgnoreNotFound(err) // the pool's Degraded condition says so
	}
	key := client.ObjectKeyFromObject(dp)
	a.mu.Lock()
	st, ok := a.pairs[key]
	if !ok {
		st = &pairState{series: map[string]*autoscale.Series{}}
		a.pairs[key] = st
	}
	a.mu.Unlock()
	now := time.Now()

	window := time.Duration(spec.WindowSeconds) * time.Second
	growth, span, complete, err := a.measure(ctx, dp, pp, st, now, window)
	if err != nil {
		return err
	}
	warm, pods, err := a.engines(ctx, dp, pp, now, time.Duration(ptr.Deref(spec.WarmupSeconds, kvv1.DefaultWarmupSeconds))*time.Second)
	if err != nil {
		return err
	}
	w := autoscale.Measure(growth, span, complete, warm, percentile(spec.TTFT), percentile(spec.ITL))
	t := targetsOf(dp, pp)
	status := autoscalingStatus(dp, pp)
	current := autoscale.Sizes{Prefill: status.DesiredPrefillReplicas, Decode: status.DesiredDecodeReplicas}
	applied := autoscale.Sizes{Prefill: status.PrefillReplicas, Decode: status.DecodeReplicas}

	cond := metav1.Condition{Type: kvv1.ConditionAutoscaling, ObservedGeneration: dp.Generation}
	if need := t.Cost(autoscale.Sizes{Prefill: t.Prefill.Min, Decode: t.Decode.Min}); need > t.Budget {
		cond.Status, cond.Reason = metav1.ConditionFalse, kvv1.ReasonAutoscalingBudgetTooSmall
		cond.Message = fmt.Sprintf("spec.autoscaling.acceleratorBudget %d does not hold the minimums: %d prefill engines of %d accelerators and %d decode "+
			"engines of %d need %d; sizes are held until it does", t.Budget, t.Prefill.Min, t.PrefillPerEngine, t.Decode.Min, t.DecodePerEngine, need)
		return a.publish(ctx, dp, status, cond, applied)
	}
	d := autoscale.Decide(autoscale.Input{Now: now, Targets: t, Current: current, Window: w, State: st.learned})
	st.learned = d.State
	next, waiting := autoscale.Step(d.Desired, applied, pods, t)

	status.DesiredPrefillReplicas, status.DesiredDecodeReplicas = d.Desired.Prefill, d.Desired.Decode
	status.PrefillReplicas, status.DecodeReplicas = next.Prefill, next.Decode
	status.Signals = signalsOf(w, d.State)
	cond.Status, cond.Reason, cond.Message = metav1.ConditionTrue, d.Reason, d.Message
	switch d.Reason {
	case autoscale.BudgetExhausted, autoscale.AtMaxReplicas:
		cond.Status = metav1.ConditionFalse
	case autoscale.MetricsUnavailable:
		cond.Status = metav1.ConditionUnknown
	}
	if waiting && cond.Status == metav1.ConditionTrue {
		cond.Reason = kvv1.ReasonRebalancing
		cond.Message += fmt.Sprintf("; running prefill %d, decode %d until the shrinking role's pods are gone (prefill pods %d, decode pods %d)",
			next.Prefill, next.Decode, pods.Prefill, pods.Decode)
	}
	recordAutoscalerMetrics(dp, status)
	return a.publish(ctx, dp, status, cond, applied)
}

// publish writes status.autoscaling and the Autoscaling condition when they changed, and
// tells of a change of size, or of a condition reason, in an event.
func (a *autoscaler) publish(ctx context.Context, dp *kvv1.DecodePool, st *kvv1.AutoscalingStatus, cond metav1.Condition, was autoscale.Sizes) error {
	before := dp.DeepCopy()
	var old *metav1.Condition // a copy: SetStatusCondition changes the one in the list
	if c := meta.FindStatusCondition(dp.Status.Conditions, kvv1.ConditionAutoscaling); c != nil {
		old = c.DeepCopy()
	}
	resized := st.PrefillReplicas != was.Prefill || st.DecodeReplicas != was.Decode
	if resized {
		st.LastScaleTime = &metav1.Time{Time: time.Now()}
	}
	dp.Status.Autoscaling = st
	meta.SetStatusCondition(&dp.Status.Conditions, cond)
	if equality.Semantic.DeepEqual(before.Status, dp.Status) {
		return nil
	}
	if err := a.client.Status().Patch(ctx, dp, client.MergeFromWithOptions(before, client.MergeFromWithOptimisticLock{})); err != nil {
		return err
	}
	switch {
	case resized:
		reason := kvv1.ReasonScaledUp
		if st.PrefillReplicas+st.DecodeReplicas < was.Prefill+was.Decode ||
			(st.PrefillReplicas < was.Prefill && st.DecodeReplicas <= was.Decode) || (st.DecodeReplicas < was.Decode && st.PrefillReplicas <= was.Prefill) {
			reason = kvv1.ReasonScaledDown
		}
		a.recorder.Eventf(dp, nil, corev1.EventTypeNormal, reason, "Autoscale", "prefill %d→%d, decode %d→%d (%s): %s",
			was.Prefill, st.PrefillReplicas, was.Decode, st.DecodeReplicas, cond.Reason, cond.Message)
	case old == nil || old.Status != cond.Status || (cond.Status != metav1.ConditionTrue && old.Reason != cond.Reason):
		// A decision that changes nothing is not news; one that cannot be carried out
		// (over the budget or a maximum, no measurements) is, once.
		kind := corev1.EventTypeNormal
		if cond.Status == metav1.ConditionFalse {
			kind = corev1.EventTypeWarning
		}
		a.recorder.Eventf(dp, nil, kind, cond.Reason, "Autoscale", "%s", cond.Message)
	}
	return nil
}

// measure polls the pair's load sources and returns each one's growth over the window.
// complete is false when a source that should report (a ready router or leg runner)
// did not, or has not reported for half the window yet.
func (a *autoscaler) measure(ctx context.Context, dp *kvv1.DecodePool, pp *kvv1.PrefillPool, st *pairState, now time.Time, window time.Duration) ([]load.Report, time.Duration, bool, error) {
	sources, err := a.sources(ctx, dp)
	if err != nil {
		return nil, 0, false, err
	}
	// What a report may name: the pair's engines now.
	prefill, decode := engineIDs(pp.Status.Engines), engineIDs(dp.Status.Engines)
	reports := make([]*load.Report, len(sources))
	var wg sync.WaitGroup
	// A few reports decoded at once: each may hold up to load.MaxReportBytes until it
	// is restricted to the pair's engines.
	sem := make(chan struct{}, 8)
	for i, s := range sources {
		wg.Go(func() {
			sem <- struct{}{}
			defer func() { <-sem }()
			reports[i] = a.fetch(ctx, s.url, prefill, decode)
		})
	}
	wg.Wait()
	complete := true
	var growth []load.Report
	var span time.Duration
	live := map[string]bool{}
	for i, s := range sources {
		live[s.pod] = true
		series := st.series[s.pod]
		if series == nil {
			series = &autoscale.Series{}
			st.series[s.pod] = series
		}
		if reports[i] != nil {
			series.Add(now, *reports[i], window)
		}
		g, covered := series.Growth(window)
		if s.ready && (reports[i] == nil || covered < window/2) {
			complete = false
		}
		if covered > 0 {
			growth = append(growth, g)
			span = max(span, covered)
		}
	}
	for pod := range st.series {
		if !live[pod] {
			delete(st.series, pod)
		}
	}
	return growth, span, complete, nil
}

// loadSource is a pod serving GET /load: a router of the pool or a decode engine's leg runner.
type loadSource struct {
	pod, url string
	ready    bool
}

func (a *autoscaler) sources(ctx context.Context, dp *kvv1.DecodePool) ([]loadSource, error) {
	var out []loadSource
	routers := &corev1.PodList{}
	if err := a.client.List(ctx, routers, client.InNamespace(dp.Namespace), client.MatchingLabels{kvv1.LabelRouter: dp.Name}); err != nil {
		return nil, err
	}
	for i := range routers.Items {
		pod := &routers.Items[i]
		if url := routerHealthURL(pod); url != "" && routerManaged(ctx, a.client, pod) {
			out = append(out, loadSource{pod: pod.Name, url: url[:len(url)-len("/health/transfer")] + "/load", ready: podReady(pod) && pod.DeletionTimestamp == nil})
		}
	}
	if !dp.Spec.Gateway.InferencePool {
		return out, nil
	}
	// Behind a gateway the leg runner in each decode engine pod routes what reaches it.
	engines := &corev1.PodList{}
	if err := a.client.List(ctx, engines, client.InNamespace(dp.Namespace), client.MatchingLabels(render.SelectorLabels(kvv1.RoleDecode, dp.Name))); err != nil {
		return nil, err
	}
	for i := range engines.Items {
		pod := &engines.Items[i]
		sts := &appsv1.StatefulSet{}
		if pod.Status.PodIP == "" || pod.DeletionTimestamp != nil || !controlledBy(ctx, a.client, pod, sts, "StatefulSet", dp.Name) ||
			!controlledBy(ctx, a.client, sts, &kvv1.DecodePool{}, "DecodePool", dp.Name) || !statefulSetPod(pod, sts) {
			continue
		}
		url := fmt.Sprintf("http://%s/load", net.JoinHostPort(pod.Status.PodIP, strconv.Itoa(render.LegRunnerAdminPort)))
		out = append(out, loadSource{pod: pod.Name, url: url, ready: podReady(pod) && pod.DeletionTimestamp == nil})
	}
	return out, nil
}

// fetch reads one source's report, restricted to the pair's engines; nil when it has
// none to give, or gives what a router does not (refused, and logged).
func (a *autoscaler) fetch(ctx context.Context, url string, prefill, decode map[string]bool) *load.Report {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return nil
	}
	resp, err := a.http.Do(req)
	if err != nil {
		return nil
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil
	}
	var r load.Report
	body := &io.LimitedReader{R: resp.Body, N: load.MaxReportBytes + 1}
	err = json.NewDecoder(body).Decode(&r)
	if err == nil && body.N == 0 {
		err = fmt.Errorf("larger than %d bytes", load.MaxReportBytes)
	}
	if err == nil {
		_, err = r.Restrict(prefill, decode)
	}
	if err != nil {
		log.FromContext(ctx).Info("refused a load report", "url", url, "err", err.Error())
		return nil
	}
	return &r
}

// engineIDs are the engine ids of a pool's engines.
func engineIDs(engines []kvv1.EngineStatus) map[string]bool {
	ids := make(map[string]bool, len(engines))
	for _, e := range engines {
		ids[e.EngineID] = true
	}
	return ids
}

// engines returns which engines are past their warmup, by engine id (an id of no
// current pod counts as warm: it served before it went), and how many pods each role
// has, terminating ones included: they hold their accelerators until they are gone.
func (a *autoscaler) engines(ctx context.Context, dp *kvv1.DecodePool, pp *kvv1.PrefillPool, now time.Time, warmup time.Duration) (func(string) bool, autoscale.Sizes, error) {
	cold := map[string]bool{}
	var pods autoscale.Sizes
	for _, role := range []struct {
		role   kvv1.Role
		name   string
		status *kvv1.PoolStatus
		count  *int32
	}{{kvv1.RolePrefill, pp.Name, &pp.Status, &pods.Prefill}, {kvv1.RoleDecode, dp.Name, &dp.Status, &pods.Decode}} {
		list := &corev1.PodList{}
		if err := a.client.List(ctx, list, client.InNamespace(dp.Namespace), client.MatchingLabels(render.SelectorLabels(role.role, role.name))); err != nil {
			return nil, pods, err
		}
		ids := map[string]string{}
		for _, e := range role.status.Engines {
			ids[e.PodName] = e.EngineID
		}
		for i := range list.Items {
			pod := &list.Items[i]
			*role.count++
			if id := ids[pod.Name]; id != "" && (!podReady(pod) || now.Sub(readySince(pod)) < warmup) {
				cold[id] = true
			}
		}
	}
	return func(id string) bool { return !cold[id] }, pods, nil
}

// readySince is when the pod became Ready (zero when not known: long enough ago).
func readySince(pod *corev1.Pod) time.Time {
	for _, c := range pod.Status.Conditions {
		if c.Type == corev1.PodReady && c.Status == corev1.ConditionTrue {
			return c.LastTransitionTime.Time
		}
	}
	return time.Time{}
}

// targetsOf reads a pair's targets from its spec.
func targetsOf(dp *kvv1.DecodePool, pp *kvv1.PrefillPool) autoscale.Targets {
	s := dp.Spec.Autoscaling
	return autoscale.Targets{
		TTFT: time.Duration(s.TTFT.Milliseconds) * time.Millisecond, ITL: time.Duration(s.ITL.Milliseconds) * time.Millisecond,
		TTFTPercentile: percentile(s.TTFT), ITLPercentile: percentile(s.ITL),
		Prefill: autoscale.Range{Min: s.Prefill.MinReplicas, Max: s.Prefill.MaxReplicas},
		Decode:  autoscale.Range{Min: s.Decode.MinReplicas, Max: s.Decode.MaxReplicas},
		Budget:  s.AcceleratorBudget, PrefillPerEngine: acceleratorsPerEngine(&pp.Spec.EngineSpec), DecodePerEngine: acceleratorsPerEngine(&dp.Spec.EngineSpec),
		Stabilization: time.Duration(ptr.Deref(s.StabilizationWindowSeconds, kvv1.DefaultStabilizationWindowSeconds)) * time.Second,
	}
}

// acceleratorsPerEngine is what one engine of a pool takes from the budget: its
// accelerator.count, or tensorParallelSize × pipelineParallelSize; a CPU engine counts one.
func acceleratorsPerEngine(e *kvv1.EngineSpec) int32 {
	if e.Accelerator.Type == kvv1.AcceleratorCPU {
		return 1
	}
	if e.Accelerator.Count > 0 {
		return e.Accelerator.Count
	}
	return max(e.TensorParallelSize, 1) * max(e.PipelineParallelSize, 1)
}

func percentile(t kvv1.LatencyTarget) float64 {
	return float64(cmp.Or(t.Percentile, kvv1.DefaultLatencyPercentile)) / 100
}

// autoscalingStatus is the DecodePool's status.autoscaling to update: a copy of the
// last one, or for a pool that has none yet, sizes from each pool's spec.replicas
// within the ranges.
func autoscalingStatus(dp *kvv1.DecodePool, pp *kvv1.PrefillPool) *kvv1.AutoscalingStatus {
	if st := dp.Status.Autoscaling; st != nil && st.PrefillReplicas > 0 && st.DecodeReplicas > 0 {
		return st.DeepCopy()
	}
	s := dp.Spec.Autoscaling
	p := clampReplicas(ptr.Deref(pp.Spec.Replicas, 1), s.Prefill)
	d := clampReplicas(ptr.Deref(dp.Spec.Replicas, 1), s.Decode)
	return &kvv1.AutoscalingStatus{PrefillReplicas: p, DecodeReplicas: d, DesiredPrefillReplicas: p, DesiredDecodeReplicas: d}
}

func clampReplicas(n int32, r kvv1.ReplicaRange) int32 {
	return min(max(n, r.MinReplicas), r.MaxReplicas)
}

func signalsOf(w autoscale.Window, st autoscale.State) *kvv1.AutoscalingSignals {
	s := &kvv1.AutoscalingSignals{PrefillTokensPerSecondPerEngine: int64(st.PrefillRate), DecodeInFlight: int64(w.DecodeInFlight + 0.5)}
	if w.Span > 0 {
		s.PromptTokensPerSecond = int64(w.PromptTokens / w.Span.Seconds())
	}
	if w.TTFTSamples > 0 {
		s.TTFTMilliseconds = w.TTFT.Milliseconds()
	}
	if w.ITLSamples > 0 {
		s.ITLMilliseconds = w.ITL.Milliseconds()
	}
	return s
}

var (
	autoscalerReplicas = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "kvhandoff_autoscaler_replicas",
		Help: "Replicas per role of an autoscaled pair: desired (the last decision) and applied (what the pools run now, within the budget mid-rebalance).",
	}, []string{"namespace", "pool", "role", "kind"})
	autoscalerSignal = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "kvhandoff_autoscaler_signal",
		Help: "What the last decision of an autoscaled pair was made from: ttft_seconds and itl_seconds at the targets' percentiles, " +
			"prompt_tokens_per_second, prefill_tokens_per_second_per_engine (learned), decode_in_flight.",
	}, []string{"namespace", "pool", "signal"})
)

func init() { metrics.Registry.MustRegister(autoscalerReplicas, autoscalerSignal) }

func recordAutoscalerMetrics(dp *kvv1.DecodePool, st *kvv1.AutoscalingStatus) {
	ns, name := dp.Namespace, dp.Name
	for _, r := range []struct {
		role, kind string
		v          int32
	}{{"prefill", "desired", st.DesiredPrefillReplicas}, {"prefill", "applied", st.PrefillReplicas},
		{"decode", "desired", st.DesiredDecodeReplicas}, {"decode", "applied", st.DecodeReplicas}} {
		autoscalerReplicas.WithLabelValues(ns, name, r.role, r.kind).Set(float64(r.v))
	}
	s := st.Signals
	for sig, v := range map[string]float64{"ttft_seconds": float64(s.TTFTMilliseconds) / 1e3, "itl_seconds": float64(s.ITLMilliseconds) / 1e3,
		"prompt_tokens_per_second": float64(s.PromptTokensPerSecond), "prefill_tokens_per_second_per_engine": float64(s.PrefillTokensPerSecondPerEngine),
		"decode_in_flight": float64(s.DecodeInFlight)} {
		autoscalerSignal.WithLabelValues(ns, name, sig).Set(v)
	}
}

func forgetAutoscalerMetrics(namespace, name string) {
	labels := prometheus.Labels{"namespace": namespace, "pool": name}
	autoscalerReplicas.DeletePartialMatch(labels)
	autoscalerSignal.DeletePartialMatch(labels)
}
