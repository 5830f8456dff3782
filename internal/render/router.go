package render

import (
	"fmt"
	"maps"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/utils/ptr"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
	"github.com/kvhandoff/kvhandoff/internal/instancetype"
)

// endpointsPropagationSeconds is how long a deleted router or endpoint picker pod keeps
// serving before it stops taking new connections: the time for its removal from its
// Service's endpoints to reach kube-proxy and gateways.
const endpointsPropagationSeconds = 5

// RouterPort is where the router serves clients: the OpenAI API and its probes.
// RouterAdminPort is where it serves operators: /metrics and the health report the
// manager polls. Only RouterPort is in the Service.
const (
	RouterPort      = 8000
	RouterAdminPort = 8001
)

// RouterInput is what a DecodePool's router renders from.
type RouterInput struct {
	// Pool and Namespace are the DecodePool's.
	Pool, Namespace string
	Spec            *kvv1.RouterSpec
	// DefaultImage is the router image of the manager's version, used when the spec
	// names none.
	DefaultImage string
	// KVEventsSecret, when the engines serve their KV events (RoutingSpec.KVEvents), is
	// the Secret of the token their sidecars ask for (KVEventsSecret); "" for none.
	KVEventsSecret string
}

// ServiceWorkload is what a DecodePool's router or endpoint picker renders to.
type ServiceWorkload struct {
	ServiceAccount *corev1.ServiceAccount
	Role           *rbacv1.Role
	RoleBinding    *rbacv1.RoleBinding
	// NetworkPolicy, when set, admits only the workload's clients (the endpoint picker's).
	NetworkPolicy *networkingv1.NetworkPolicy
	Deployment    *appsv1.Deployment
	Service       *corev1.Service
	PDB           *policyv1.PodDisruptionBudget
}

// Objects lists the workload's objects in the order they are applied: identity,
// permissions and the network policy before the pods they govern.
func (w *ServiceWorkload) Objects() []metav1.Object {
	objs := []metav1.Object{w.ServiceAccount, w.Role, w.RoleBinding}
	if w.NetworkPolicy != nil {
		objs = append(objs, w.NetworkPolicy)
	}
	return append(objs, w.Deployment, w.Service, w.PDB)
}

// LabelManagedBy is on every object the manager renders besides engines, ManagedBy its
// value; the manager caches those kinds by it.
const (
	LabelManagedBy = "app.kubernetes.io/managed-by"
	ManagedBy      = "kvhandoff"
)

// RouterName is the name of a DecodePool's router objects and of its Service.
func RouterName(pool string) string { return pool + "-router" }

// RouterSelectorLabels select the router pods of one DecodePool.
func RouterSelectorLabels(pool string) map[string]string {
	return map[string]string{kvv1.LabelRouter: pool}
}

// Router renders a DecodePool's router: a Deployment of stateless replicas off the
// accelerator nodes, its Service, a PodDisruptionBudget, and a ServiceAccount whose
// Role reads only the namespace's pools and pods.
func Router(in RouterInput) (*ServiceWorkload, error) {
	image := in.Spec.Image
	if image == "" {
		image = in.DefaultImage
	}
	// The pool label puts router pods in the manager's cache of pods (it polls their
	// health reports); without the role label they are never taken for engines.
	return serviceWorkload(serviceInput{
		pool: in.Pool, namespace: in.Namespace, name: RouterName(in.Pool), component: "router",
		selector: RouterSelectorLabels(in.Pool), podLabels: map[string]string{kvv1.LabelPool: in.Pool},
		image: image, replicas: ptr.Deref(in.Spec.Replicas, 2), resources: in.Spec.Resources, kvEventsSecret: in.KVEventsSecret,
		args: []string{fmt.Sprintf("--listen=:%d", RouterPort), fmt.Sprintf("--admin-listen=:%d", RouterAdminPort)},
		ports: []corev1.ContainerPort{
			{Name: "http", ContainerPort: RouterPort, Protocol: corev1.ProtocolTCP},
			{Name: "admin", ContainerPort: RouterAdminPort, Protocol: corev1.ProtocolTCP},
		},
		// Ready once it has read its engines, pair or none: without a pair every replica
		// would fail /readyz at once, leaving clients the Service's connection refused
		// instead of the router's 503 naming why (internal/router: discovered).
		readiness: routerProbe("/discovered", 5, 2), liveness: routerProbe("/healthz", 10, 3),
		service: corev1.ServicePort{Name: "http", Port: RouterPort, TargetPort: intstr.FromString("http"), Protocol: corev1.ProtocolTCP},
	})
}

// serviceInput is a stateless Deployment of the router binary behind a Service.
type serviceInput struct {
	pool, namespace, name, component string
	selector, podLabels              map[string]string
	image                            string
	// networkPolicy, when set, renders the workload's NetworkPolicy for its pods' selector.
	networkPolicy       func(selector map[string]string) *networkingv1.NetworkPolicy
	command             []string // the image's entrypoint when empty
	replicas            int32
	resources           *corev1.ResourceRequirements
	args                []string // after --decode-pool and --namespace
	ports               []corev1.ContainerPort
	readiness, liveness *corev1.Probe
	service             corev1.ServicePort
	kvEventsSecret      string // mounted, and its token file named, when set
}

func serviceWorkload(in serviceInput) (*ServiceWorkload, error) {
	labels := maps.Clone(in.selector)
	maps.Copy(labels, map[string]string{
		"app.kubernetes.io/name":      "kvhandoff-" + in.component,
		"app.kubernetes.io/instance":  in.pool,
		"app.kubernetes.io/component": in.component,
		LabelManagedBy:                ManagedBy,
	})
	meta := func(kind, apiVersion string) (metav1.TypeMeta, metav1.ObjectMeta) {
		return metav1.TypeMeta{Kind: kind, APIVersion: apiVersion}, metav1.ObjectMeta{Name: in.name, Namespace: in.namespace, Labels: maps.Clone(labels)}
	}
	w := &ServiceWorkload{}
	w.ServiceAccount = &corev1.ServiceAccount{}
	w.ServiceAccount.TypeMeta, w.ServiceAccount.ObjectMeta = meta("ServiceAccount", "v1")
	w.Role = &rbacv1.Role{Rules: poolReaderRules()}
	w.Role.TypeMeta, w.Role.ObjectMeta = meta("Role", "rbac.authorization.k8s.io/v1")
	w.RoleBinding = &rbacv1.RoleBinding{
		RoleRef:  rbacv1.RoleRef{APIGroup: "rbac.authorization.k8s.io", Kind: "Role", Name: in.name},
		Subjects: []rbacv1.Subject{{Kind: "ServiceAccount", Name: in.name, Namespace: in.namespace}},
	}
	w.RoleBinding.TypeMeta, w.RoleBinding.ObjectMeta = meta("RoleBinding", "rbac.authorization.k8s.io/v1")

	container := serviceContainer(in)
	var volumes []corev1.Volume
	if in.kvEventsSecret != "" {
		v, m := kvEventsTokenVolume(in.kvEventsSecret)
		volumes, container.VolumeMounts = []corev1.Volume{v}, []corev1.VolumeMount{m}
		container.Args = append(container.Args, "--kv-events-token-file="+kvEventsTokenFile)
	}
	podLabels := maps.Clone(labels)
	maps.Copy(podLabels, in.podLabels)
	pod := corev1.PodTemplateSpec{
		ObjectMeta: metav1.ObjectMeta{Labels: podLabels},
		Spec: corev1.PodSpec{
			ServiceAccountName: in.name,
			Containers:         []corev1.Container{container},
			Volumes:            volumes,
			Affinity:           routerAffinity(in.selector),
			// In-flight requests get this long to finish after it stops taking new ones.
			TerminationGracePeriodSeconds: ptr.To[int64](60 + endpointsPropagationSeconds),
			EnableServiceLinks:            ptr.To(false),
		},
	}
	w.Deployment = &appsv1.Deployment{Spec: appsv1.DeploymentSpec{
		Replicas: ptr.To(in.replicas),
		Selector: &metav1.LabelSelector{MatchLabels: in.selector},
		// Keep every replica serving while a new one starts: a rollout never lowers capacity.
		Strategy: appsv1.DeploymentStrategy{Type: appsv1.RollingUpdateDeploymentStrategyType, RollingUpdate: &appsv1.RollingUpdateDeployment{
			MaxUnavailable: ptr.To(intstr.FromInt32(0)), MaxSurge: ptr.To(intstr.FromInt32(1)),
		}},
		Template: pod,
	}}
	w.Deployment.TypeMeta, w.Deployment.ObjectMeta = meta("Deployment", "apps/v1")
	w.Service = &corev1.Service{Spec: corev1.ServiceSpec{
		Type:     corev1.ServiceTypeClusterIP,
		Selector: in.selector,
		Ports:    []corev1.ServicePort{in.service},
	}}
	w.Service.TypeMeta, w.Service.ObjectMeta = meta("Service", "v1")
	w.PDB = &policyv1.PodDisruptionBudget{Spec: oneAtATime(in.selector)}
	w.PDB.TypeMeta, w.PDB.ObjectMeta = meta("PodDisruptionBudget", "policy/v1")
	if in.networkPolicy != nil {
		w.NetworkPolicy = in.networkPolicy(in.selector)
		w.NetworkPolicy.TypeMeta, w.NetworkPolicy.ObjectMeta = meta("NetworkPolicy", "networking.k8s.io/v1")
	}

	for _, obj := range w.Objects() {
		if err := stamp(obj); err != nil {
			return nil, err
		}
	}
	return w, nil
}

// serviceContainer is the workload's one container: its program with the pool's flags,
// restricted, bounded in memory, and draining only once no new connection can come.
func serviceContainer(in serviceInput) corev1.Container {
	resources := corev1.ResourceRequirements{
		Requests: corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("100m"), corev1.ResourceMemory: resource.MustParse("128Mi")},
		Limits:   corev1.ResourceList{corev1.ResourceMemory: resource.MustParse("512Mi")},
	}
	if in.resources != nil {
		resources = *in.resources
	}

	return corev1.Container{
		Name:            in.component,
		Image:           in.image,
		Command:         in.command,
		Args:            append([]string{"--decode-pool=" + in.pool, "--namespace=$(POD_NAMESPACE)"}, in.args...),
		Env:             []corev1.EnvVar{fieldEnv("POD_NAMESPACE", "metadata.namespace"), goMemLimit()},
		Ports:           in.ports,
		ReadinessProbe:  in.readiness,
		LivenessProbe:   in.liveness,
		Resources:       resources,
		SecurityContext: restrictedContainer(),
		// A deleted pod stays in its Service's endpoints until kube-proxy (or a
		// gateway) hears of it; it keeps taking connections that long, and stops only
		// then (SIGTERM: finish what is in flight, take nothing new). Stopping at once
		// refused connections meant for it (measured on the real node: an endpoint picker
		// deleted under traffic through Envoy, one request in 11 answered an empty 500).
		Lifecycle: &corev1.Lifecycle{PreStop: &corev1.LifecycleHandler{Sleep: &corev1.SleepAction{Seconds: endpointsPropagationSeconds}}},
	}
}

// poolReaderRules let the router binary follow a DecodePool: read the namespace's pools
// and pods, nothing else.
func poolReaderRules() []rbacv1.PolicyRule {
	return []rbacv1.PolicyRule{
		{APIGroups: []string{kvv1.GroupVersion.Group}, Resources: []string{"decodepools", "prefillpools"}, Verbs: []string{"get", "list", "watch"}},
		{APIGroups: []string{""}, Resources: []string{"pods"}, Verbs: []string{"get", "list", "watch"}},
	}
}

func restrictedContainer() *corev1.SecurityContext {
	return &corev1.SecurityContext{
		RunAsNonRoot:             ptr.To(true),
		ReadOnlyRootFilesystem:   ptr.To(true),
		AllowPrivilegeEscalation: ptr.To(false),
		Capabilities:             &corev1.Capabilities{Drop: []corev1.Capability{"ALL"}},
		SeccompProfile:           &corev1.SeccompProfile{Type: corev1.SeccompProfileTypeRuntimeDefault},
	}
}

// routerAffinity keeps routers off accelerator nodes (every instance type kvhandoff
// knows carries accelerators: the router needs none), prefers nodes without a transfer
// agent (engines' nodes), and spreads replicas over nodes. The agent rule is only a
// preference: CPU engines run on ordinary nodes, and a small cluster may have no other.
func routerAffinity(selector map[string]string) *corev1.Affinity {
	return &corev1.Affinity{
		NodeAffinity: &corev1.NodeAffinity{
			RequiredDuringSchedulingIgnoredDuringExecution: &corev1.NodeSelector{
				NodeSelectorTerms: []corev1.NodeSelectorTerm{{MatchExpressions: []corev1.NodeSelectorRequirement{
					{Key: labelInstanceType, Operator: corev1.NodeSelectorOpNotIn, Values: instancetype.Accelerated()},
				}}},
			},
			PreferredDuringSchedulingIgnoredDuringExecution: []corev1.PreferredSchedulingTerm{{Weight: 100, Preference: corev1.NodeSelectorTerm{
				MatchExpressions: []corev1.NodeSelectorRequirement{{Key: kvv1.LabelAgentReady, Operator: corev1.NodeSelectorOpDoesNotExist}},
			}}},
		},
		PodAntiAffinity: &corev1.PodAntiAffinity{PreferredDuringSchedulingIgnoredDuringExecution: []corev1.WeightedPodAffinityTerm{{
			Weight:          100,
			PodAffinityTerm: corev1.PodAffinityTerm{LabelSelector: &metav1.LabelSelector{MatchLabels: selector}, TopologyKey: labelHostname},
		}}},
	}
}

func routerProbe(path string, period, failures int32) *corev1.Probe {
	p := httpProbe(path, period, failures)
	p.TimeoutSeconds = 2
	return p
}
