package controller

import (
	"context"
	"fmt"
	"net"
	"slices"
	"strconv"
	"strings"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
	"github.com/kvhandoff/kvhandoff/internal/health"
	"github.com/kvhandoff/kvhandoff/internal/render"
)

// observed is what the manager reads of a pool's workload to compute its status.
type observed struct {
	// statefulSet is the pool's own StatefulSet; nil when there is none (or only someone
	// else's of the same name, which a NameConflict reports).
	statefulSet *appsv1.StatefulSet
	// engines are the engine pods that have an IP, in pod-name order.
	engines []kvv1.EngineStatus
	// pending are the engine pods the scheduler cannot place (sorted), and its reason.
	pending       []string
	schedulerSays string
	// agents are the transfer agents of the engines' nodes, by node; routers are the
	// health reports of a DecodePool's routers, by pod.
	agents  map[string]agentView
	routers map[string]health.Report
}

// updateStatus observes the pool's workload, computes its status (poolStatus, a pure
// function) and patches it only when it changed. Events are sent only once the patch
// succeeded, so none tells of a state nobody can read.
func (r *PoolReconciler) updateStatus(ctx context.Context, p pool, before client.Object, v *validation) error {
	obs, err := r.observe(ctx, p)
	if err != nil {
		return err
	}
	st := poolStatus(p, v, obs)
	*p.status() = st
	recordMetrics(p, v.replicas, len(obs.pending))

	old := poolOf(before).status()
	if equality.Semantic.DeepEqual(*old, st) {
		return nil
	}
	// The patch carries the resourceVersion the status was computed from: a reconcile that
	// read a stale copy conflicts and runs again on the fresh one, instead of writing the
	// same status a second time and sending its events twice.
	if err := r.Status().Patch(ctx, p.object(), client.MergeFromWithOptions(before, client.MergeFromWithOptimisticLock{})); err != nil {
		return err
	}
	for _, e := range statusEvents(old, &st) {
		r.Recorder.Eventf(p.object(), nil, e.kind, e.reason, e.action, "%s", e.message)
	}
	return nil
}

// observe reads the pool's StatefulSet and engine pods.
func (r *PoolReconciler) observe(ctx context.Context, p pool) (observed, error) {
	var obs observed
	sts := &appsv1.StatefulSet{}
	err := r.Get(ctx, client.ObjectKeyFromObject(p.object()), sts)
	switch {
	case apierrors.IsNotFound(err):
	case err != nil:
		return obs, err
	case metav1.IsControlledBy(sts, p.object()):
		obs.statefulSet = sts
	}
	pods := &corev1.PodList{}
	if err := r.List(ctx, pods, client.InNamespace(p.GetNamespace()), client.MatchingLabels(render.SelectorLabels(p.role(), p.GetName()))); err != nil {
		return obs, err
	}
	// Anyone who may create pods in the namespace can give one the pool's labels: only
	// the StatefulSet's own engines are published (routers send them prompts).
	pods.Items = slices.DeleteFunc(pods.Items, func(pod corev1.Pod) bool { return !statefulSetPod(&pod, obs.statefulSet) })
	obs.engines, obs.pending, obs.schedulerSays = engines(pods.Items)
	obs.agents = map[string]agentView{}
	for _, e := range obs.engines {
		if e.Agent == "" || e.NodeName == "" {
			continue
		}
		if _, seen := obs.agents[e.NodeName]; seen {
			continue
		}
		node := &metav1.PartialObjectMetadata{}
		node.SetGroupVersionKind(corev1.SchemeGroupVersion.WithKind("Node"))
		err := r.Get(ctx, client.ObjectKey{Name: e.NodeName}, node)
		if client.IgnoreNotFound(err) != nil {
			return obs, err
		}
		var a agentView
		if err == nil {
			a.ready = node.Labels[kvv1.LabelAgentReady] == "true"
			a.report, a.reported = health.Parse(node.Annotations[kvv1.AnnotationAgentHealth])
		}
		obs.agents[e.NodeName] = a
	}
	if p.role() == kvv1.RoleDecode && r.routers != nil {
		obs.routers = r.routers.of(p.GetNamespace(), p.GetName())
	}
	return obs, nil
}

// poolStatus is the status of p given what validation found and what was observed of
// its workload: the condition table of the pool kinds, with no reads and no writes.
func poolStatus(p pool, v *validation, obs observed) kvv1.PoolStatus {
	st := *p.status().DeepCopy()
	gen := p.object().GetGeneration()
	st.ObservedGeneration = gen
	st.Selector = labels.SelectorFromSet(render.SelectorLabels(p.role(), p.GetName())).String()
	var provider kvv1.FabricProvider
	if v.policy != nil {
		st.Mode, st.HandoffFailurePolicy = v.policy.Spec.Mode, v.policy.Spec.HandoffFailurePolicy
		st.HandoffFailureLimitPercent = ptr.Deref(v.policy.Spec.HandoffFailureLimitPercent, kvv1.DefaultHandoffFailureLimitPercent)
		st.HealthWindowSeconds = ptr.Deref(v.policy.Spec.HealthWindowSeconds, kvv1.DefaultHealthWindowSeconds)
		st.Routing = v.policy.Spec.Routing.DeepCopy()
		provider = v.policy.Spec.Fabric.Provider
	}
	st.RouterService = ""
	if routerEnabled(p) && v.problem == nil {
		st.RouterService = render.RouterName(p.GetName())
	}
	sts := obs.statefulSet
	desired := v.replicas
	rolled := sts != nil && rolledOut(sts)
	st.Replicas, st.ReadyReplicas, st.CompatHash = 0, 0, ""
	if sts != nil {
		st.Replicas, st.ReadyReplicas = sts.Status.Replicas, sts.Status.ReadyReplicas
		if rolled {
			st.CompatHash = sts.Spec.Template.Labels[kvv1.LabelCompatHash]
		}
	}
	st.Engines = slices.Clone(obs.engines)
	// The StatefulSet's ready count is kube-controller-manager's reading of the pods, and
	// it lags them while its watches do (after a control-plane outage they back off for up
	// to a minute): an engine pod the kubelet says is not ready is not counted, whatever
	// the StatefulSet says, so a crashed engine turns the pool not Ready at once.
	var up int32
	for _, e := range st.Engines {
		if e.Ready {
			up++
		}
	}
	if up < int32(len(st.Engines)) {
		st.ReadyReplicas = min(st.ReadyReplicas, up)
	}
	transfer := transferHealth(st.Engines, obs.agents, obs.routers, provider)
	st.Warnings = nil
	for _, w := range v.warnings {
		st.Warnings = append(st.Warnings, kvv1.PoolWarning{Reason: w.Reason, Message: w.Message})
	}
	unschedulable := ""
	if len(obs.pending) > 0 {
		unschedulable = fmt.Sprintf("%d engine(s) cannot be scheduled (%s): %s", len(obs.pending), strings.Join(obs.pending, ", "), obs.schedulerSays)
	}

	ready := v.problem == nil && rolled && st.ReadyReplicas == desired
	set := func(t string, status metav1.ConditionStatus, reason, message string) {
		meta.SetStatusCondition(&st.Conditions, metav1.Condition{Type: t, Status: status, Reason: reason, Message: message, ObservedGeneration: gen})
	}
	const valid = "the pool and its policy are valid"
	switch {
	case v.problem != nil:
		set(kvv1.ConditionReady, metav1.ConditionFalse, v.problem.Reason, v.problem.Message)
		set(kvv1.ConditionDegraded, metav1.ConditionTrue, v.problem.Reason, v.problem.Message)
		set(kvv1.ConditionProgressing, metav1.ConditionFalse, v.problem.Reason,
			"nothing is rolled out until the problem in the Degraded condition is fixed; running engines are left as they are")
	case unschedulable != "":
		reason, unschedulable := unschedulableReason(p, v, unschedulable)
		set(kvv1.ConditionReady, metav1.ConditionFalse, reason, unschedulable)
		set(kvv1.ConditionDegraded, metav1.ConditionTrue, reason, unschedulable)
		set(kvv1.ConditionProgressing, metav1.ConditionTrue, kvv1.ReasonRollingOut, progress(sts, st.ReadyReplicas, desired))
	case transfer.Status == metav1.ConditionFalse:
		// The engines serve, but their KV does not move as the policy says: slow
		// (another provider), failing, or falling back to decode alone.
		set(kvv1.ConditionReady, metav1.ConditionFalse, transfer.Reason, transfer.Message)
		set(kvv1.ConditionDegraded, metav1.ConditionTrue, transfer.Reason, transfer.Message)
		if ready {
			set(kvv1.ConditionProgressing, metav1.ConditionFalse, kvv1.ReasonRolledOut, fmt.Sprintf("%d/%d engines ready, all on the current configuration", st.ReadyReplicas, desired))
		} else {
			set(kvv1.ConditionProgressing, metav1.ConditionTrue, kvv1.ReasonRollingOut, progress(sts, st.ReadyReplicas, desired))
		}
	case ready:
		msg := fmt.Sprintf("%d/%d engines ready", st.ReadyReplicas, desired)
		set(kvv1.ConditionReady, metav1.ConditionTrue, kvv1.ReasonEnginesReady, msg)
		set(kvv1.ConditionDegraded, metav1.ConditionFalse, kvv1.ReasonAsExpected, valid)
		set(kvv1.ConditionProgressing, metav1.ConditionFalse, kvv1.ReasonRolledOut, msg+", all on the current configuration")
	default:
		msg := progress(sts, st.ReadyReplicas, desired)
		set(kvv1.ConditionReady, metav1.ConditionFalse, kvv1.ReasonEnginesNotReady, msg)
		set(kvv1.ConditionDegraded, metav1.ConditionFalse, kvv1.ReasonAsExpected, valid)
		set(kvv1.ConditionProgressing, metav1.ConditionTrue, kvv1.ReasonRollingOut, msg)
	}
	set(transfer.Type, transfer.Status, transfer.Reason, transfer.Message)
	// While autoscaling owns the pool, status says so: the DecodePool's carries the
	// sizes (the autoscaler writes them), the PrefillPool's names its owner.
	switch {
	case v.autoscaledBy == "":
		st.Autoscaling = nil
		meta.RemoveStatusCondition(&st.Conditions, kvv1.ConditionAutoscaling)
	case p.role() == kvv1.RolePrefill:
		st.Autoscaling = &kvv1.AutoscalingStatus{Owner: v.autoscaledBy, PrefillReplicas: v.replicas}
	}
	if p.role() == kvv1.RoleDecode {
		c := paired(&st, v)
		set(c.Type, c.Status, c.Reason, c.Message)
		if v.gateway != nil {
			c := inferencePoolReady(p.GetName(), v.gateway)
			set(c.Type, c.Status, c.Reason, c.Message)
		} else if !gatewayEnabled(p) {
			meta.RemoveStatusCondition(&st.Conditions, kvv1.ConditionInferencePoolReady)
		}
	}
	return st
}

// event is one event to send about a pool.
type event struct{ kind, reason, action, message string }

// statusEvents are the events a status change from old to cur tells a user: a warning
// that appeared, and each Ready, Degraded, Paired, TransferHealthy or InferencePoolReady condition whose
// status or reason changed (what a user watching `kubectl get events` needs to see).
// Ready and Degraded that only follow TransferHealthy's reason are not told again: one
// transfer problem is one Warning event. Keyed on the saved
// status rather than on the generation, a warning is sent once even when the reconcile
// that first saw the generation could not yet check it (its policy not yet in the cache).
func statusEvents(old, cur *kvv1.PoolStatus) []event {
	var out []event
	for _, w := range cur.Warnings {
		if !slices.ContainsFunc(old.Warnings, func(o kvv1.PoolWarning) bool { return o.Reason == w.Reason }) {
			out = append(out, event{corev1.EventTypeWarning, w.Reason, "Validate", w.Message})
		}
	}
	transfer := meta.FindStatusCondition(cur.Conditions, kvv1.ConditionTransferHealthy)
	for _, t := range []string{kvv1.ConditionReady, kvv1.ConditionDegraded, kvv1.ConditionPaired, kvv1.ConditionTransferHealthy, kvv1.ConditionInferencePoolReady} {
		c := meta.FindStatusCondition(cur.Conditions, t)
		if c == nil {
			continue
		}
		if t != kvv1.ConditionTransferHealthy && transfer != nil && transfer.Status == metav1.ConditionFalse && c.Reason == transfer.Reason {
			continue
		}
		if o := meta.FindStatusCondition(old.Conditions, t); o != nil && o.Status == c.Status && o.Reason == c.Reason {
			continue
		}
		bad := c.Status == metav1.ConditionFalse
		if t == kvv1.ConditionDegraded {
			bad = c.Status == metav1.ConditionTrue
		}
		// Engines starting and pools mid-rollout are normal on the way to Ready.
		transitional := c.Reason == kvv1.ReasonEnginesNotReady || c.Reason == kvv1.ReasonCompatHashMismatch
		kind := corev1.EventTypeNormal
		if bad && !transitional {
			kind = corev1.EventTypeWarning
		}
		out = append(out, event{kind, c.Reason, "Reconcile", fmt.Sprintf("%s=%s: %s", t, c.Status, c.Message)})
	}
	return out
}

// rolledOut reports whether every pod of the StatefulSet runs its current template.
// unschedulableReason is EnginesUnschedulable, or DevicesUnallocatable for a pool whose
// devices come by claim: the scheduler's message counts nodes that "cannot allocate all
// claims", and what the claims ask is what to compare with the nodes' ResourceSlices.
func unschedulableReason(p pool, v *validation, message string) (string, string) {
	if claim := render.DeviceClaimSummary(p.engine(), v.policy); claim != "" {
		return kvv1.ReasonDevicesUnallocatable, message + "; " + claim
	}
	return kvv1.ReasonEnginesUnschedulable, message
}

func rolledOut(sts *appsv1.StatefulSet) bool {
	want := ptr.Deref(sts.Spec.Replicas, 1)
	s := sts.Status
	return s.ObservedGeneration == sts.Generation && s.Replicas == want && s.UpdatedReplicas == want &&
		(s.CurrentRevision == "" || s.CurrentRevision == s.UpdateRevision)
}

func progress(sts *appsv1.StatefulSet, ready, desired int32) string {
	if sts == nil {
		return fmt.Sprintf("creating %d engines", desired)
	}
	return fmt.Sprintf("%d/%d engines ready, %d on the current configuration", ready, desired, sts.Status.UpdatedReplicas)
}

// paired is the DecodePool's Paired condition: True only when both pools run engines
// with the same compat-hash.
func paired(st *kvv1.PoolStatus, v *validation) metav1.Condition {
	c := metav1.Condition{Type: kvv1.ConditionPaired, Status: metav1.ConditionFalse}
	switch {
	case v.problem != nil:
		c.Reason, c.Message = v.problem.Reason, v.problem.Message
	case st.CompatHash == "" || v.prefill.Status.CompatHash == "":
		c.Reason = kvv1.ReasonCompatHashMismatch
		c.Message = fmt.Sprintf("waiting for both pools to finish rolling out (this pool's compat-hash %q, PrefillPool %s's %q)",
			st.CompatHash, v.prefill.Name, v.prefill.Status.CompatHash)
	case st.CompatHash != v.prefill.Status.CompatHash:
		c.Reason = kvv1.ReasonCompatHashMismatch
		c.Message = fmt.Sprintf("this pool's engines have compat-hash %s but PrefillPool %s's have %s: model, KV-cache dtype, mode, connector or "+
			"image differ", st.CompatHash, v.prefill.Name, v.prefill.Status.CompatHash)
	default:
		c.Status, c.Reason = metav1.ConditionTrue, kvv1.ReasonCompatible
		c.Message = fmt.Sprintf("engines of this pool and PrefillPool %s have compat-hash %s", v.prefill.Name, st.CompatHash)
	}
	return c
}

// statefulSetPod reports whether pod is one of sts's (nil: none is): controlled by it,
// by UID, and named for an ordinal below its replicas. A pod that copied the
// StatefulSet's owner reference and took an ordinal above them is not one (the
// StatefulSet controller deletes it too, in its own time).
func statefulSetPod(pod *corev1.Pod, sts *appsv1.StatefulSet) bool {
	if sts == nil {
		return false
	}
	ref := metav1.GetControllerOf(pod)
	if ref == nil || ref.Kind != "StatefulSet" || ref.UID != sts.UID {
		return false
	}
	ordinal, ok := strings.CutPrefix(pod.Name, sts.Name+"-")
	n, err := strconv.ParseInt(ordinal, 10, 32)
	return ok && err == nil && strconv.FormatInt(n, 10) == ordinal && n >= 0 && n < int64(ptr.Deref(sts.Spec.Replicas, 1))
}

// engines lists the identity of every engine pod that has an IP, in pod-name order, and
// the engines the scheduler cannot place (sorted) with its reason.
func engines(pods []corev1.Pod) (engines []kvv1.EngineStatus, pending []string, schedulerSays string) {
	for _, pod := range pods {
		if pod.DeletionTimestamp != nil {
			continue
		}
		for _, c := range pod.Status.Conditions {
			if c.Type == corev1.PodScheduled && c.Status == corev1.ConditionFalse && c.Reason == corev1.PodReasonUnschedulable {
				pending = append(pending, pod.Name)
				schedulerSays = c.Message
			}
		}
		if pod.Status.PodIP == "" {
			continue
		}
		// An executor-Agent engine's KV side channel is its node's transfer agent.
		var agent string
		if pod.Labels[kvv1.LabelExecutor] == string(kvv1.ExecutorAgent) && pod.Status.HostIP != "" {
			agent = net.JoinHostPort(pod.Status.HostIP, strconv.Itoa(render.AgentPeerPort))
		}
		// What the pod runs, from the labels it was rendered with: mid-rollout an old pod
		// keeps its old sizes and hash.
		engines = append(engines, kvv1.EngineStatus{
			Agent:                agent,
			PodName:              pod.Name,
			EngineID:             render.EngineID(pod.Name, pod.Namespace),
			Host:                 pod.Status.PodIP,
			SideChannelPort:      render.SideChannelPort,
			TensorParallelSize:   labelInt(pod.Labels, kvv1.LabelTensorParallelSize),
			PipelineParallelSize: labelInt(pod.Labels, kvv1.LabelPipelineParallelSize),
			NodeName:             pod.Spec.NodeName,
			CompatHash:           pod.Labels[kvv1.LabelCompatHash],
			Ready:                podReady(&pod),
		})
	}
	slices.SortFunc(engines, func(a, b kvv1.EngineStatus) int { return strings.Compare(a.PodName, b.PodName) })
	slices.Sort(pending)
	return engines, pending, schedulerSays
}

// labelInt reads a numeric label; 0 when it is missing or not a number (a pod rendered
// before the label existed), which no engine runs with, so nothing reads it as real.
func labelInt(labels map[string]string, key string) int32 {
	n, err := strconv.ParseInt(labels[key], 10, 32)
	if err != nil {
		return 0
	}
	return int32(n)
}

func podReady(pod *corev1.Pod) bool {
	for _, c := range pod.Status.Conditions {
		if c.Type == corev1.PodReady {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}
