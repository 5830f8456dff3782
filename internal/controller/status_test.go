package controller

import (
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
	"github.com/kvhandoff/kvhandoff/internal/compat"
	"github.com/kvhandoff/kvhandoff/test/builder"
)

// rolled is a StatefulSet of n replicas, all on the current template with compat-hash
// hash, ready of them ready.
func rolled(n, ready int32, hash string) *appsv1.StatefulSet {
	sts := &appsv1.StatefulSet{}
	sts.Generation = 1
	sts.Spec.Replicas = ptr.To(n)
	sts.Spec.Template.Labels = map[string]string{kvv1.LabelCompatHash: hash}
	sts.Status = appsv1.StatefulSetStatus{ObservedGeneration: 1, Replicas: n, UpdatedReplicas: n, ReadyReplicas: ready}
	return sts
}

func TestPoolStatusConditionTable(t *testing.T) {
	policy := builder.Policy("policy").Obj()
	cases := []struct {
		name                      string
		v                         validation
		obs                       observed
		ready, degraded, progress string // reason of each condition
		readyStatus               metav1.ConditionStatus
	}{
		{"a problem stops everything", validation{problem: &problem{Reason: kvv1.ReasonPolicyNotFound, Message: "m"}}, observed{},
			kvv1.ReasonPolicyNotFound, kvv1.ReasonPolicyNotFound, kvv1.ReasonPolicyNotFound, metav1.ConditionFalse},
		{"engines the scheduler cannot place degrade the pool", validation{policy: policy, replicas: 1}, observed{pending: []string{"p-0"}, schedulerSays: "0/2 nodes"},
			kvv1.ReasonEnginesUnschedulable, kvv1.ReasonEnginesUnschedulable, kvv1.ReasonRollingOut, metav1.ConditionFalse},
		{"every engine ready and rolled out is Ready", validation{policy: policy, replicas: 1}, observed{statefulSet: rolled(1, 1, "h")},
			kvv1.ReasonEnginesReady, kvv1.ReasonAsExpected, kvv1.ReasonRolledOut, metav1.ConditionTrue},
		{"engines starting are progressing", validation{policy: policy, replicas: 1}, observed{statefulSet: rolled(1, 0, "h")},
			kvv1.ReasonEnginesNotReady, kvv1.ReasonAsExpected, kvv1.ReasonRollingOut, metav1.ConditionFalse},
		// kube-controller-manager's count lags the kubelet's word after an API-server
		// outage (its watches back off): a crashed engine is not ready at once.
		{"an engine pod not ready is not ready, whatever the StatefulSet says", validation{policy: policy, replicas: 2},
			observed{statefulSet: rolled(2, 2, "h"), engines: []kvv1.EngineStatus{{PodName: "p-0", Ready: true}, {PodName: "p-1"}}},
			kvv1.ReasonEnginesNotReady, kvv1.ReasonAsExpected, kvv1.ReasonRollingOut, metav1.ConditionFalse},
		{"no StatefulSet yet is progressing", validation{policy: policy, replicas: 1}, observed{},
			kvv1.ReasonEnginesNotReady, kvv1.ReasonAsExpected, kvv1.ReasonRollingOut, metav1.ConditionFalse},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			p := builder.PrefillPool("p").Obj()
			p.Generation = 3
			st := poolStatus(prefillPool{p}, &c.v, c.obs)
			for typ, reason := range map[string]string{kvv1.ConditionReady: c.ready, kvv1.ConditionDegraded: c.degraded,
				kvv1.ConditionProgressing: c.progress} {
				got := meta.FindStatusCondition(st.Conditions, typ)
				if got == nil || got.Reason != reason || got.ObservedGeneration != 3 {
					t.Errorf("%s = %+v, want reason %s at generation 3", typ, got, reason)
				}
			}
			if got := meta.FindStatusCondition(st.Conditions, kvv1.ConditionReady).Status; got != c.readyStatus {
				t.Errorf("Ready = %s, want %s", got, c.readyStatus)
			}
			if st.ObservedGeneration != 3 {
				t.Errorf("observedGeneration = %d, want 3", st.ObservedGeneration)
			}
		})
	}
}

func TestPoolStatusPairsADecodePoolOnlyWithEqualHashes(t *testing.T) {
	prefill := builder.PrefillPool("p").Obj()
	for _, c := range []struct {
		name, mine, theirs string
		want               metav1.ConditionStatus
	}{
		{"equal hashes pair", "h", "h", metav1.ConditionTrue},
		{"different hashes do not", "h", "g", metav1.ConditionFalse},
		{"a pool mid-rollout does not", "h", "", metav1.ConditionFalse},
	} {
		prefill.Status.CompatHash = c.theirs
		d := builder.DecodePool("d", "p").Obj()
		st := poolStatus(decodePool{d}, &validation{policy: builder.Policy("policy").Obj(), prefill: prefill, replicas: 1}, observed{statefulSet: rolled(1, 1, c.mine)})
		if got := meta.FindStatusCondition(st.Conditions, kvv1.ConditionPaired); got == nil || got.Status != c.want {
			t.Errorf("%s: Paired = %+v, want %s", c.name, got, c.want)
		}
	}
}

// A warning is an event once, when it first appears in the saved status, whatever the
// generation: the reconcile that first sees a pool may not reach the check that finds it.
func TestStatusEventsSendAWarningOnceWhenItAppears(t *testing.T) {
	w := kvv1.PoolWarning{Reason: compat.WarningEngineVersionUnknown, Message: "cannot read a vLLM version"}
	policyMissing := kvv1.PoolStatus{ObservedGeneration: 1, Conditions: []metav1.Condition{
		{Type: kvv1.ConditionReady, Status: metav1.ConditionFalse, Reason: kvv1.ReasonPolicyNotFound},
	}}
	checked := *policyMissing.DeepCopy()
	checked.Warnings = []kvv1.PoolWarning{w}
	checked.Conditions = []metav1.Condition{{Type: kvv1.ConditionReady, Status: metav1.ConditionFalse, Reason: kvv1.ReasonEnginesNotReady}}

	warnings := func(evs []event) (n int) {
		for _, e := range evs {
			if e.reason == w.Reason && e.kind == corev1.EventTypeWarning {
				n++
			}
		}
		return n
	}
	if n := warnings(statusEvents(&policyMissing, &checked)); n != 1 {
		t.Errorf("the generation's first check found the warning: %d events, want 1", n)
	}
	if n := warnings(statusEvents(&checked, &checked)); n != 0 {
		t.Errorf("an unchanged warning: %d events, want 0", n)
	}
}

func TestStatusEventsForConditionTransitions(t *testing.T) {
	cond := func(typ string, s metav1.ConditionStatus, reason string) kvv1.PoolStatus {
		return kvv1.PoolStatus{Conditions: []metav1.Condition{{Type: typ, Status: s, Reason: reason}}}
	}
	for _, c := range []struct {
		name     string
		old, cur kvv1.PoolStatus
		want     []event
	}{
		{"a problem is a Warning", kvv1.PoolStatus{}, cond(kvv1.ConditionDegraded, metav1.ConditionTrue, kvv1.ReasonPolicyNotFound),
			[]event{{corev1.EventTypeWarning, kvv1.ReasonPolicyNotFound, "Reconcile", "Degraded=True: "}}},
		{"engines starting are Normal", kvv1.PoolStatus{}, cond(kvv1.ConditionReady, metav1.ConditionFalse, kvv1.ReasonEnginesNotReady),
			[]event{{corev1.EventTypeNormal, kvv1.ReasonEnginesNotReady, "Reconcile", "Ready=False: "}}},
		{"no change, no event", cond(kvv1.ConditionReady, metav1.ConditionTrue, kvv1.ReasonEnginesReady), cond(kvv1.ConditionReady,
			metav1.ConditionTrue, kvv1.ReasonEnginesReady), nil},
	} {
		got := statusEvents(&c.old, &c.cur)
		if len(got) != len(c.want) || (len(got) > 0 && got[0] != c.want[0]) {
			t.Errorf("%s: events %+v, want %+v", c.name, got, c.want)
		}
	}
}
