package render

import (
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/utils/ptr"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
)

// Gateway pods carry one of these labels: Gateway API implementations that run the
// gateway as pods (Istio, kgateway, ...) set the first, Envoy Gateway the second.
const (
	labelGatewayName      = "gateway.networking.k8s.io/gateway-name"
	labelEnvoyGatewayName = "gateway.envoyproxy.io/owning-gateway-name"
)

// pickerNetworkPolicy admits only the gateway to the endpoint picker's gRPC port: anyone
// else could hold picks open and learn the engines' addresses. Its metrics port stays
// open (Prometheus). The kubelet's probes come from the node, which NetworkPolicy never
// blocks.
func pickerNetworkPolicy(in GatewayInput, selector map[string]string) *networkingv1.NetworkPolicy {
	var clients []networkingv1.NetworkPolicyPeer
	for _, c := range in.Spec.PickerClients {
		peer := networkingv1.NetworkPolicyPeer{PodSelector: c.PodSelector, NamespaceSelector: c.NamespaceSelector}
		if c.IPBlock != nil {
			peer.IPBlock = &networkingv1.IPBlock{CIDR: c.IPBlock.CIDR, Except: c.IPBlock.Except}
		}
		clients = append(clients, peer)
	}
	if len(clients) == 0 {
		anyNamespace := &metav1.LabelSelector{}
		clients = []networkingv1.NetworkPolicyPeer{
			{NamespaceSelector: anyNamespace, PodSelector: exists(labelGatewayName)},
			{NamespaceSelector: anyNamespace, PodSelector: exists(labelEnvoyGatewayName)},
		}
	}
	return &networkingv1.NetworkPolicy{
		Spec: networkingv1.NetworkPolicySpec{
			PodSelector: metav1.LabelSelector{MatchLabels: selector},
			PolicyTypes: []networkingv1.PolicyType{networkingv1.PolicyTypeIngress},
			Ingress: []networkingv1.NetworkPolicyIngressRule{
				{From: clients, Ports: []networkingv1.NetworkPolicyPort{tcpPorts(EPPPort, 0)}},
				{Ports: []networkingv1.NetworkPolicyPort{tcpPorts(EPPAdminPort, 0)}},
			},
		},
	}
}

// KVEventsNetworkPolicyName is the name of a pool's NetworkPolicy for its sidecars.
func KVEventsNetworkPolicyName(pool string) string { return pool + "-kv-events" }

// kvEventsNetworkPolicy admits only kvhandoff's routers and endpoint pickers of the
// namespace to the kv-events sidecars' port of a pool's engines (they still present the
// pool's token), and leaves every other port of the engine pods as open as it was: a
// NetworkPolicy that selects a pod isolates all of it, so the rule names every other
// port (TCP by ranges around the sidecar's, all of UDP and SCTP).
func kvEventsNetworkPolicy(in Input) *networkingv1.NetworkPolicy {
	meta := objectMeta(in)
	meta.Name = KVEventsNetworkPolicyName(in.Name)
	all := func(p corev1.Protocol) networkingv1.NetworkPolicyPort {
		return networkingv1.NetworkPolicyPort{Protocol: ptr.To(p)}
	}
	return &networkingv1.NetworkPolicy{
		TypeMeta:   metav1.TypeMeta{APIVersion: "networking.k8s.io/v1", Kind: "NetworkPolicy"},
		ObjectMeta: meta,
		Spec: networkingv1.NetworkPolicySpec{
			PodSelector: metav1.LabelSelector{MatchLabels: SelectorLabels(in.Role, in.Name)},
			PolicyTypes: []networkingv1.PolicyType{networkingv1.PolicyTypeIngress},
			Ingress: []networkingv1.NetworkPolicyIngressRule{
				{Ports: []networkingv1.NetworkPolicyPort{tcpPorts(1, KVEventsPort-1), tcpPorts(KVEventsPort+1, 65535), all(corev1.ProtocolUDP), all(corev1.ProtocolSCTP)}},
				{
					From:  []networkingv1.NetworkPolicyPeer{{PodSelector: exists(kvv1.LabelRouter)}, {PodSelector: exists(kvv1.LabelEndpointPicker)}},
					Ports: []networkingv1.NetworkPolicyPort{tcpPorts(KVEventsPort, 0)},
				},
			},
		},
	}
}

// tcpPorts is TCP port from, to end (0: from alone).
func tcpPorts(from, end int32) networkingv1.NetworkPolicyPort {
	p := networkingv1.NetworkPolicyPort{Protocol: ptr.To(corev1.ProtocolTCP), Port: ptr.To(intstr.FromInt32(from))}
	if end != 0 {
		p.EndPort = ptr.To(end)
	}
	return p
}

func exists(key string) *metav1.LabelSelector {
	return &metav1.LabelSelector{MatchExpressions: []metav1.LabelSelectorRequirement{{Key: key, Operator: metav1.LabelSelectorOpExists}}}
}
