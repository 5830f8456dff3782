package controller

import (
	"github.com/prometheus/client_golang/prometheus"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/metrics"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
)

// Pool metrics, served with controller-runtime's on the manager's metrics endpoint: what a
// dashboard graphs and an alert fires on ("decode pool not Paired for 5 minutes").
var (
	poolEngines = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "kvhandoff_pool_engines",
		Help: "Engines of a pool: desired (spec.replicas), ready, and unschedulable (Pending for lack of capacity or placement).",
	}, []string{"namespace", "pool", "role", "state"})
	poolCondition = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "kvhandoff_pool_condition",
		Help: "1 when the pool's condition of this type is True, 0 otherwise.",
	}, []string{"namespace", "pool", "role", "type"})
	transferProblem = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "kvhandoff_pool_transfer_problem",
		Help: "1 while the pool's TransferHealthy condition is False, labelled with its reason (AgentNotReady, ProviderFallback, ...).",
	}, []string{"namespace", "pool", "role", "reason"})
)

func init() {
	metrics.Registry.MustRegister(poolEngines, poolCondition, transferProblem)
}

// recordMetrics publishes a pool's status as metrics.
func recordMetrics(p pool, desired int32, unschedulable int) {
	ns, name, role := p.GetNamespace(), p.GetName(), string(p.role())
	st := p.status()
	poolEngines.WithLabelValues(ns, name, role, "desired").Set(float64(desired))
	poolEngines.WithLabelValues(ns, name, role, "ready").Set(float64(st.ReadyReplicas))
	poolEngines.WithLabelValues(ns, name, role, "unschedulable").Set(float64(unschedulable))
	for _, t := range []string{kvv1.ConditionReady, kvv1.ConditionProgressing, kvv1.ConditionDegraded, kvv1.ConditionPaired, kvv1.ConditionTransferHealthy} {
		c := meta.FindStatusCondition(st.Conditions, t)
		if c == nil {
			continue
		}
		v := 0.0
		if c.Status == metav1.ConditionTrue {
			v = 1
		}
		poolCondition.WithLabelValues(ns, name, role, t).Set(v)
	}
	// One series per pool while its transfers are unhealthy, labelled with the reason an
	// alert names; none while they are healthy.
	transferProblem.DeletePartialMatch(prometheus.Labels{"namespace": ns, "pool": name, "role": role})
	if c := meta.FindStatusCondition(st.Conditions, kvv1.ConditionTransferHealthy); c != nil && c.Status == metav1.ConditionFalse {
		transferProblem.WithLabelValues(ns, name, role, c.Reason).Set(1)
	}
}

// forgetMetrics drops a deleted pool's series.
func forgetMetrics(namespace, name string, role kvv1.Role) {
	labels := prometheus.Labels{"namespace": namespace, "pool": name, "role": string(role)}
	poolEngines.DeletePartialMatch(labels)
	poolCondition.DeletePartialMatch(labels)
	transferProblem.DeletePartialMatch(labels)
}
