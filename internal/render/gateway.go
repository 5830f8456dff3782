package render

import (
	"fmt"

	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/utils/ptr"
	infv1 "sigs.k8s.io/gateway-api-inference-extension/api/v1"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
)

// Ports of the gateway path. The InferencePool's target port is each decode engine
// pod's leg runner; the endpoint picker serves ext_proc and gRPC health on its own port.
const (
	LegRunnerPort      = 8100
	LegRunnerAdminPort = 8101
	EPPPort            = 9002
	EPPAdminPort       = 9003
)

// GatewayInput is what a DecodePool's gateway objects render from.
type GatewayInput struct {
	Pool, Namespace string
	Spec            *kvv1.GatewaySpec
	// Image is the router image (the endpoint picker is a mode of it).
	Image string
	// Resources are the router's, which the picker's pods take too.
	Resources *corev1.ResourceRequirements
	// KVEventsSecret is as RouterInput's.
	KVEventsSecret string
}

// EndpointPickerName is the name of a DecodePool's endpoint picker objects and Service.
func EndpointPickerName(pool string) string { return pool + "-epp" }

// EndpointPicker renders a DecodePool's endpoint picker (the router image's
// /endpoint-picker) as a Deployment beside the routers, and its gRPC Service.
func EndpointPicker(in GatewayInput) (*ServiceWorkload, error) {
	grpcProbe := func(service string, period, failures int32) *corev1.Probe {
		return &corev1.Probe{
			ProbeHandler:     corev1.ProbeHandler{GRPC: &corev1.GRPCAction{Port: EPPPort, Service: ptr.To(service)}},
			PeriodSeconds:    period,
			FailureThreshold: failures,
			TimeoutSeconds:   2,
		}
	}
	return serviceWorkload(serviceInput{
		pool: in.Pool, namespace: in.Namespace, name: EndpointPickerName(in.Pool), component: "endpoint-picker",
		selector: map[string]string{kvv1.LabelEndpointPicker: in.Pool},
		image:    in.Image, command: []string{"/endpoint-picker"},
		networkPolicy: func(selector map[string]string) *networkingv1.NetworkPolicy { return pickerNetworkPolicy(in, selector) },
		replicas:      ptr.Deref(in.Spec.EndpointPickerReplicas, 2), resources: in.Resources, kvEventsSecret: in.KVEventsSecret,
		args: []string{fmt.Sprintf("--listen=:%d", EPPPort), fmt.Sprintf("--admin-listen=:%d", EPPAdminPort),
			fmt.Sprintf("--leg-runner-port=%d", LegRunnerPort)},
		ports: []corev1.ContainerPort{
			{Name: "grpc", ContainerPort: EPPPort, Protocol: corev1.ProtocolTCP},
			{Name: "admin", ContainerPort: EPPAdminPort, Protocol: corev1.ProtocolTCP},
		},
		// The EPP protocol's health services: ready while a pair of engines exists.
		readiness: grpcProbe("readiness", 5, 2), liveness: grpcProbe("liveness", 10, 3),
		service: corev1.ServicePort{Name: "grpc", Port: EPPPort, TargetPort: intstr.FromString("grpc"), Protocol: corev1.ProtocolTCP,
			AppProtocol: ptr.To("kubernetes.io/h2c")},
	})
}

// InferencePool renders the DecodePool's InferencePool: its decode engines on the
// leg-runner port, and its endpoint picker.
func InferencePool(in GatewayInput) (*infv1.InferencePool, error) {
	sel := map[infv1.LabelKey]infv1.LabelValue{}
	for k, v := range SelectorLabels(kvv1.RoleDecode, in.Pool) {
		sel[infv1.LabelKey(k)] = infv1.LabelValue(v)
	}
	mode := infv1.EndpointPickerFailClose
	if in.Spec.FailureMode == kvv1.GatewayFailOpen {
		mode = infv1.EndpointPickerFailOpen
	}
	p := &infv1.InferencePool{
		TypeMeta: metav1.TypeMeta{APIVersion: infv1.GroupVersion.String(), Kind: "InferencePool"},
		ObjectMeta: metav1.ObjectMeta{Name: in.Pool, Namespace: in.Namespace, Labels: map[string]string{
			"app.kubernetes.io/instance": in.Pool, LabelManagedBy: ManagedBy, kvv1.LabelEndpointPicker: in.Pool,
		}},
		Spec: infv1.InferencePoolSpec{
			Selector:    infv1.LabelSelector{MatchLabels: sel},
			TargetPorts: []infv1.Port{{Number: LegRunnerPort}},
			EndpointPickerRef: infv1.EndpointPickerRef{
				Group: ptr.To(infv1.Group("")), Kind: "Service", Name: infv1.ObjectName(EndpointPickerName(in.Pool)),
				Port: &infv1.Port{Number: EPPPort}, FailureMode: mode,
			},
		},
	}
	if err := stamp(p); err != nil {
		return nil, err
	}
	return p, nil
}

// LegRunnerName is the ServiceAccount (and Role) of a DecodePool's leg runners.
func LegRunnerName(pool string) string { return pool + "-leg-runner" }

// LegRunnerAccount renders the identity of a DecodePool's leg runners: a ServiceAccount
// whose Role reads only the namespace's pools and pods.
func LegRunnerAccount(pool, namespace string) (*corev1.ServiceAccount, *rbacv1.Role, *rbacv1.RoleBinding, error) {
	name := LegRunnerName(pool)
	meta := metav1.ObjectMeta{Name: name, Namespace: namespace, Labels: map[string]string{
		"app.kubernetes.io/instance": pool, "app.kubernetes.io/component": "leg-runner", LabelManagedBy: ManagedBy}}
	sa := &corev1.ServiceAccount{TypeMeta: metav1.TypeMeta{Kind: "ServiceAccount", APIVersion: "v1"}, ObjectMeta: meta}
	role := &rbacv1.Role{TypeMeta: metav1.TypeMeta{Kind: "Role", APIVersion: "rbac.authorization.k8s.io/v1"}, ObjectMeta: *meta.DeepCopy(),
		Rules: poolReaderRules()}
	rb := &rbacv1.RoleBinding{TypeMeta: metav1.TypeMeta{Kind: "RoleBinding", APIVersion: "rbac.authorization.k8s.io/v1"}, ObjectMeta: *meta.DeepCopy(),
		RoleRef:  rbacv1.RoleRef{APIGroup: "rbac.authorization.k8s.io", Kind: "Role", Name: name},
		Subjects: []rbacv1.Subject{{Kind: "ServiceAccount", Name: name, Namespace: namespace}}}
	for _, o := range []metav1.Object{sa, role, rb} {
		if err := stamp(o); err != nil {
			return nil, nil, nil, err
		}
	}
	return sa, role, rb, nil
}

// legRunner is the decode engine pod's leg-runner sidecar (a native sidecar: it starts
// before the engine and stops after it, so no request it holds loses its engine first).
// It receives the requests the gateway routes to this pod and runs both legs with the
// prefill engine the endpoint picker named; only engines of the paired PrefillPool are
// ever dialled.
func legRunner(in Input) corev1.Container {
	return corev1.Container{
		Name:          "leg-runner",
		Image:         in.LegRunnerImage,
		RestartPolicy: ptr.To(corev1.ContainerRestartPolicyAlways),
		Args: []string{"--decode-pool=" + in.Name, "--namespace=$(POD_NAMESPACE)", "--local=$(POD_IP)",
			fmt.Sprintf("--listen=:%d", LegRunnerPort), fmt.Sprintf("--admin-listen=:%d", LegRunnerAdminPort)},
		Env: []corev1.EnvVar{fieldEnv("POD_NAMESPACE", "metadata.namespace"), fieldEnv("POD_IP", "status.podIP"), goMemLimit()},
		Ports: []corev1.ContainerPort{
			{Name: "leg-runner", ContainerPort: LegRunnerPort, Protocol: corev1.ProtocolTCP},
			{Name: "leg-admin", ContainerPort: LegRunnerAdminPort, Protocol: corev1.ProtocolTCP},
		},
		// Its own health only: readiness on engine pairs would wait for this pod's own
		// readiness, which waits for it.
		ReadinessProbe: namedPortProbe("/healthz", "leg-runner", 5, 2),
		LivenessProbe:  namedPortProbe("/healthz", "leg-runner", 10, 3),
		Resources: corev1.ResourceRequirements{
			Requests: corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("100m"), corev1.ResourceMemory: resource.MustParse("64Mi")},
			Limits:   corev1.ResourceList{corev1.ResourceMemory: resource.MustParse("256Mi")},
		},
		SecurityContext: restrictedContainer(),
		VolumeMounts:    []corev1.VolumeMount{{Name: "leg-runner-token", MountPath: "/var/run/secrets/kubernetes.io/serviceaccount", ReadOnly: true}},
	}
}

// legRunnerToken is the pod's service account token, as the kubelet would mount it, for
// the leg runner alone.
func legRunnerToken() corev1.Volume {
	return corev1.Volume{Name: "leg-runner-token", VolumeSource: corev1.VolumeSource{Projected: &corev1.ProjectedVolumeSource{
		Sources: []corev1.VolumeProjection{
			{ServiceAccountToken: &corev1.ServiceAccountTokenProjection{Path: "token", ExpirationSeconds: ptr.To[int64](3607)}},
			{ConfigMap: &corev1.ConfigMapProjection{LocalObjectReference: corev1.LocalObjectReference{Name: "kube-root-ca.crt"},
				Items: []corev1.KeyToPath{{Key: "ca.crt", Path: "ca.crt"}}}},
			{DownwardAPI: &corev1.DownwardAPIProjection{Items: []corev1.DownwardAPIVolumeFile{
				{Path: "namespace", FieldRef: &corev1.ObjectFieldSelector{APIVersion: "v1", FieldPath: "metadata.namespace"}}}}},
		},
	}}}
}

// namedPortProbe is routerProbe on the container's port of that name.
func namedPortProbe(path, port string, period, failures int32) *corev1.Probe {
	p := routerProbe(path, period, failures)
	p.HTTPGet.Port = intstr.FromString(port)
	return p
}
