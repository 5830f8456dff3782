// Package render turns a pool and its policy into the objects that run its engines: a
// StatefulSet and its headless Service. Everything here is a pure function of its input,
// so it is tested with golden files and the manager can compare before it writes.
package render

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"maps"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	resourcev1 "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/utils/ptr"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
	"github.com/kvhandoff/kvhandoff/internal/compat"
)

// Ports every engine listens on.
const (
	// HTTPPort serves vLLM's OpenAI-compatible API.
	HTTPPort = 8000
	// SideChannelPort is NIXL's side channel, where peers exchange metadata before KV moves.
	// One engine per pod, so the default port is unique per host.
	SideChannelPort = 5600
)

// EngineContainer is the name of the container that runs vLLM; a pool's template
// merges into it by this name.
const EngineContainer = "engine"

// Input is everything the rendering of one pool depends on.
type Input struct {
	// Role is prefill or decode.
	Role kvv1.Role
	// Name and Namespace are the pool's.
	Name, Namespace string
	// Spec is the pool's engine spec.
	Spec *kvv1.EngineSpec
	// Policy is the spec of the pool's KVTransferPolicy.
	Policy *kvv1.KVTransferPolicySpec
	// PrefillPool is, for a decode pool, the name of the PrefillPool it pairs with; its
	// pods are the ones decode engines must not share a node with on EFA.
	PrefillPool string
	// PeerTensorParallelSize is the tensor-parallel size of the engines on the other side
	// of the pair (0: this pool's): where it differs, each rank exchanges a head slice of
	// every block with the peer ranks holding its heads.
	PeerTensorParallelSize int32
	// ConnectorImage is the image of the connector init container (executor Agent);
	// "" is DefaultConnectorImage.
	ConnectorImage string
	// LegRunnerImage, on a decode pool behind a gateway (gateway.inferencePool), is the
	// router image its pods run the leg-runner sidecar from; "" renders none.
	LegRunnerImage string
	// KVEventsImage, for pools whose policy's routing follows KV events
	// (RoutingSpec.KVEvents), is the router image its pods run the kv-events sidecar
	// from; "" renders none.
	KVEventsImage string
}

// Workload is what a pool renders to.
type Workload struct {
	StatefulSet *appsv1.StatefulSet
	Service     *corev1.Service
	// KVEventsNetworkPolicy, with kv-events sidecars, admits only routers and pickers to
	// their port.
	KVEventsNetworkPolicy *networkingv1.NetworkPolicy
	// DeviceClaims, under accelerator.allocation DRA, are the templates of each engine's
	// ResourceClaims.
	DeviceClaims []*resourcev1.ResourceClaimTemplate
	// PDB lets a drain (or any eviction) take one engine of the pool at a time.
	PDB *policyv1.PodDisruptionBudget
}

// Engines renders a pool. The error is a *compat.Problem when the pool and policy
// cannot make working engines (callers check compat first, so it is a safety net), and
// a *TemplateError when spec.template does not fit the engine pod.
func Engines(in Input) (*Workload, error) {
	if p, _ := compat.CheckPool(in.Spec, in.Policy); p != nil {
		return nil, p
	}
	claims, err := deviceClaimTemplates(in)
	if err != nil {
		return nil, err
	}
	pod, err := podTemplate(in, claims)
	if err != nil {
		return nil, err
	}
	sts := &appsv1.StatefulSet{
		TypeMeta:   metav1.TypeMeta{APIVersion: "apps/v1", Kind: "StatefulSet"},
		ObjectMeta: objectMeta(in),
		Spec: appsv1.StatefulSetSpec{
			Replicas:    ptr.To(ptr.Deref(in.Spec.Replicas, 1)),
			ServiceName: in.Name,
			Selector:    &metav1.LabelSelector{MatchLabels: SelectorLabels(in.Role, in.Name)},
			// Engines are independent of each other: start and replace them all at once
			// instead of one by one.
			PodManagementPolicy: appsv1.ParallelPodManagement,
			UpdateStrategy:      appsv1.StatefulSetUpdateStrategy{Type: appsv1.RollingUpdateStatefulSetStrategyType},
			Template:            *pod,
		},
	}
	svc := &corev1.Service{
		TypeMeta:   metav1.TypeMeta{APIVersion: "v1", Kind: "Service"},
		ObjectMeta: objectMeta(in),
		Spec: corev1.ServiceSpec{
			// Headless: each engine keeps a stable DNS name (<pod>.<pool>.<namespace>.svc).
			ClusterIP: corev1.ClusterIPNone,
			Selector:  SelectorLabels(in.Role, in.Name),
			Ports: []corev1.ServicePort{
				{Name: "http", Port: HTTPPort, TargetPort: intstr.FromString("http"), Protocol: corev1.ProtocolTCP},
				{Name: "nixl", Port: SideChannelPort, TargetPort: intstr.FromString("nixl"), Protocol: corev1.ProtocolTCP},
			},
		},
	}
	// A node drain evicts one engine at a time: the next waits until the StatefulSet's
	// replacement is Ready elsewhere, so a drain of the node running a pool's engines
	// never takes the pool to nothing.
	pdb := &policyv1.PodDisruptionBudget{
		TypeMeta:   metav1.TypeMeta{APIVersion: "policy/v1", Kind: "PodDisruptionBudget"},
		ObjectMeta: objectMeta(in),
		Spec:       oneAtATime(SelectorLabels(in.Role, in.Name)),
	}
	w := &Workload{StatefulSet: sts, Service: svc, DeviceClaims: claims, PDB: pdb}
	objs := []metav1.Object{sts, svc, pdb}
	for _, c := range claims {
		objs = append(objs, c)
	}
	if in.KVEventsImage != "" {
		w.KVEventsNetworkPolicy = kvEventsNetworkPolicy(in)
		objs = append(objs, w.KVEventsNetworkPolicy)
	}
	for _, obj := range objs {
		if err := stamp(obj); err != nil {
			return nil, err
		}
	}
	return w, nil
}

// oneAtATime is the disruption budget of every set of pods kvhandoff renders (engines,
// routers, endpoint pickers): evictions take one pod at a time. maxUnavailable rather
// than minAvailable: a set of one pod still drains. A pod that is not Ready serves
// nothing, so it may be evicted whatever the budget: a crash-looping pod does not hold
// up a drain.
func oneAtATime(selector map[string]string) policyv1.PodDisruptionBudgetSpec {
	return policyv1.PodDisruptionBudgetSpec{
		MaxUnavailable:             ptr.To(intstr.FromInt32(1)),
		Selector:                   &metav1.LabelSelector{MatchLabels: selector},
		UnhealthyPodEvictionPolicy: ptr.To(policyv1.AlwaysAllow),
	}
}

// SelectorLabels select the engine pods of one pool. They never change for the life of
// a pool, because a StatefulSet's selector is immutable.
func SelectorLabels(role kvv1.Role, pool string) map[string]string {
	return map[string]string{kvv1.LabelPool: pool, kvv1.LabelRole: string(role)}
}

// EngineID is the vLLM engine_id of the engine in pod name of namespace: unique across
// the cluster, different for prefill and decode, and stable across pod restarts.
func EngineID(pod, namespace string) string { return pod + "." + namespace }

func objectMeta(in Input) metav1.ObjectMeta {
	labels := SelectorLabels(in.Role, in.Name)
	maps.Copy(labels, map[string]string{
		"app.kubernetes.io/name":       "vllm",
		"app.kubernetes.io/instance":   in.Name,
		"app.kubernetes.io/component":  string(in.Role),
		"app.kubernetes.io/managed-by": "kvhandoff",
	})
	return metav1.ObjectMeta{Name: in.Name, Namespace: in.Namespace, Labels: labels}
}

// stamp records the hash of what was rendered on the object, so the manager can tell
// "nothing changed" without a write.
func stamp(obj metav1.Object) error {
	h, err := hashJSON(obj)
	if err != nil {
		return err
	}
	obj.SetAnnotations(map[string]string{kvv1.AnnotationRenderedHash: h})
	return nil
}

func hashJSON(v any) (string, error) {
	data, err := json.Marshal(v)
	if err != nil {
		return "", fmt.Errorf("hashing rendered object: %w", err)
	}
	sum := sha256.Sum256(data)
	return hex.EncodeToString(sum[:])[:16], nil
}
