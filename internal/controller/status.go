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
	"github.com/kvhandoff/kvhandoff/internal/render"
)

// updateStatus observes the pool's StatefulSet and pods, sets status and conditions,
// and patches the status subresource only when something changed.
func (r *PoolReconciler) updateStatus(ctx context.Context, p pool, before client.Object, v *validation) error {
	st := p.status()
	gen := p.object().GetGeneration()
	st.ObservedGeneration = gen
	st.Selector = labels.SelectorFromSet(render.SelectorLabels(p.role(), p.object().GetName())).String()
	if v.policy != nil {
		st.Mode = v.policy.Spec.Mode
	}
	st.RouterService = ""
	if routerEnabled(p) && v.problem == nil {
		st.RouterService = render.RouterName(p.object().GetName())
	}

	sts := &appsv1.StatefulSet{}
	err := r.Get(ctx, client.ObjectKeyFromObject(p.object()), sts)
	switch {
	case apierrors.IsNotFound(err):
		sts = nil
	case err != nil:
		return err
	}
	if sts != nil && !metav1.IsControlledBy(sts, p.object()) {
		sts = nil // someone else's object of the same name; a NameConflict says so
	}
	desired := ptr.Deref(p.engine().Replicas, 1)
	rolled := sts != nil && rolledOut(sts)
	st.Replicas, st.ReadyReplicas, st.CompatHash = 0, 0, ""
	if sts != nil {
		st.Replicas, st.ReadyReplicas = sts.Status.Replicas, sts.Status.ReadyReplicas
		if rolled {
			st.CompatHash = sts.Spec.Template.Labels[kvv1.LabelCompatHash]
		}
	}
	engines, pending, schedulerSays, err := r.engines(ctx, p)
	if err != nil {
		return err
	}
	st.Engines = engines
	unschedulable := ""
	if len(pending) > 0 {
		unschedulable = fmt.Sprintf("%d engine(s) cannot be scheduled (%s): %s", len(pending), strings.Join(pending, ", "), schedulerSays)
	}

	ready := v.problem == nil && rolled && st.ReadyReplicas == desired
	set := func(c metav1.Condition) {
		c.ObservedGeneration = gen
		meta.SetStatusCondition(&st.Conditions, c)
	}
	switch {
	case v.problem != nil:
		set(metav1.Condition{Type: kvv1.ConditionReady, Status: metav1.ConditionFalse, Reason: v.problem.Reason, Message: v.problem.Message})
		set(metav1.Condition{Type: kvv1.ConditionDegraded, Status: metav1.ConditionTrue, Reason: v.problem.Reason, Message: v.problem.Message})
		set(metav1.Condition{Type: kvv1.ConditionProgressing, Status: metav1.ConditionFalse, Reason: v.problem.Reason, Message: "nothing is rolled out until the problem in the Degraded condition is fixed; running engines are left as they are"})
	case unschedulable != "":
		set(metav1.Condition{Type: kvv1.ConditionReady, Status: metav1.ConditionFalse, Reason: kvv1.ReasonEnginesUnschedulable, Message: unschedulable})
		set(metav1.Condition{Type: kvv1.ConditionDegraded, Status: metav1.ConditionTrue, Reason: kvv1.ReasonEnginesUnschedulable, Message: unschedulable})
		set(metav1.Condition{Type: kvv1.ConditionProgressing, Status: metav1.ConditionTrue, Reason: kvv1.ReasonRollingOut, Message: progress(sts, desired)})
	case ready:
		msg := fmt.Sprintf("%d/%d engines ready", st.ReadyReplicas, desired)
		set(metav1.Condition{Type: kvv1.ConditionReady, Status: metav1.ConditionTrue, Reason: kvv1.ReasonEnginesReady, Message: msg})
		set(metav1.Condition{Type: kvv1.ConditionDegraded, Status: metav1.ConditionFalse, Reason: kvv1.ReasonAsExpected, Message: "the pool and its policy are valid"})
		set(metav1.Condition{Type: kvv1.ConditionProgressing, Status: metav1.ConditionFalse, Reason: kvv1.ReasonRolledOut, Message: msg + ", all on the current configuration"})
	default:
		msg := progress(sts, desired)
		set(metav1.Condition{Type: kvv1.ConditionReady, Status: metav1.ConditionFalse, Reason: kvv1.ReasonEnginesNotReady, Message: msg})
		set(metav1.Condition{Type: kvv1.ConditionDegraded, Status: metav1.ConditionFalse, Reason: kvv1.ReasonAsExpected, Message: "the pool and its policy are valid"})
		set(metav1.Condition{Type: kvv1.ConditionProgressing, Status: metav1.ConditionTrue, Reason: kvv1.ReasonRollingOut, Message: msg})
	}
	if p.role() == kvv1.RoleDecode {
		set(paired(st, v))
	}
	recordMetrics(p, desired, len(pending))

	old := poolOf(before).status()
	if old.ObservedGeneration != gen {
		for _, w := range v.warnings {
			r.Recorder.Eventf(p.object(), nil, corev1.EventTypeWarning, w.Reason, "Validate", "%s", w.Message)
		}
	}
	if equality.Semantic.DeepEqual(old, st) {
		return nil
	}
	r.recordTransitions(p.object(), old.Conditions, st.Conditions)
	return r.Status().Patch(ctx, p.object(), client.MergeFrom(before))
}

// recordTransitions emits an event for each Ready, Degraded or Paired condition whose
// status or reason changed: what a user watching `kubectl get events` needs to see.
func (r *PoolReconciler) recordTransitions(obj client.Object, old, cur []metav1.Condition) {
	for _, t := range []string{kvv1.ConditionReady, kvv1.ConditionDegraded, kvv1.ConditionPaired} {
		c := meta.FindStatusCondition(cur, t)
		if c == nil {
			continue
		}
		if o := meta.FindStatusCondition(old, t); o != nil && o.Status == c.Status && o.Reason == c.Reason {
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
		r.Recorder.Eventf(obj, nil, kind, c.Reason, "Reconcile", "%s=%s: %s", t, c.Status, c.Message)
	}
}

// rolledOut reports whether every pod of the StatefulSet runs its current template.
func rolledOut(sts *appsv1.StatefulSet) bool {
	want := ptr.Deref(sts.Spec.Replicas, 1)
	s := sts.Status
	return s.ObservedGeneration == sts.Generation && s.Replicas == want && s.UpdatedReplicas == want &&
		(s.CurrentRevision == "" || s.CurrentRevision == s.UpdateRevision)
}

func progress(sts *appsv1.StatefulSet, desired int32) string {
	if sts == nil {
		return fmt.Sprintf("creating %d engines", desired)
	}
	return fmt.Sprintf("%d/%d engines ready, %d on the current configuration", sts.Status.ReadyReplicas, desired, sts.Status.UpdatedReplicas)
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
		c.Message = fmt.Sprintf("waiting for both pools to finish rolling out (this pool's compat-hash %q, PrefillPool %s's %q)", st.CompatHash, v.prefill.Name, v.prefill.Status.CompatHash)
	case st.CompatHash != v.prefill.Status.CompatHash:
		c.Reason = kvv1.ReasonCompatHashMismatch
		c.Message = fmt.Sprintf("this pool's engines have compat-hash %s but PrefillPool %s's have %s: model, KV-cache dtype, mode, connector or image differ", st.CompatHash, v.prefill.Name, v.prefill.Status.CompatHash)
	default:
		c.Status, c.Reason = metav1.ConditionTrue, kvv1.ReasonCompatible
		c.Message = fmt.Sprintf("engines of this pool and PrefillPool %s have compat-hash %s", v.prefill.Name, st.CompatHash)
	}
	return c
}

// engines lists the identity of every engine pod that has an IP, in pod-name order, and
// the engines the scheduler cannot place (sorted) with its reason.
func (r *PoolReconciler) engines(ctx context.Context, p pool) (engines []kvv1.EngineStatus, pending []string, schedulerSays string, err error) {
	pods := &corev1.PodList{}
	if err := r.List(ctx, pods, client.InNamespace(p.object().GetNamespace()), client.MatchingLabels(render.SelectorLabels(p.role(), p.object().GetName()))); err != nil {
		return nil, nil, "", err
	}
	for _, pod := range pods.Items {
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
	return engines, pending, schedulerSays, nil
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
