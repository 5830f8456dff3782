package render

import (
	"testing"

	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
)

// admits reports whether rule admits TCP port p (from the peers the rule names).
func admits(rule networkingv1.NetworkPolicyIngressRule, p int32) bool {
	for _, np := range rule.Ports {
		if *np.Protocol != corev1.ProtocolTCP {
			continue
		}
		end := np.Port.IntVal
		if np.EndPort != nil {
			end = *np.EndPort
		}
		if p >= np.Port.IntVal && p <= end {
			return true
		}
	}
	return false
}

// The sidecars' policy closes their port to all but routers and pickers, and leaves every
// other port of the engine pods open to anyone: TCP by ranges, all of UDP and SCTP.
func TestTheKVEventsPolicyClosesTheSidecarsPortAlone(t *testing.T) {
	np := kvEventsNetworkPolicy(Input{Role: kvv1.RoleDecode, Name: "d", Namespace: "ns"})
	open, followers := np.Spec.Ingress[0], np.Spec.Ingress[1]
	if len(open.From) != 0 || len(followers.From) != 2 {
		t.Fatalf("peers: open %v, followers %v", open.From, followers.From)
	}
	for p := int32(1); p <= 65535; p++ {
		if admits(open, p) == (p == KVEventsPort) {
			t.Errorf("port %d: open to anyone %v", p, admits(open, p))
		}
	}
	if !admits(followers, KVEventsPort) {
		t.Error("the followers are not admitted to the sidecars' port")
	}
	protocols := map[corev1.Protocol]bool{}
	for _, p := range open.Ports {
		if p.Port == nil {
			protocols[*p.Protocol] = true
		}
	}
	if !protocols[corev1.ProtocolUDP] || !protocols[corev1.ProtocolSCTP] {
		t.Errorf("whole protocols open: %v, want UDP and SCTP", protocols)
	}
}

// The picker admits the gateway's pods by default, the pool's pickerClients when set.
func TestThePickersPolicyAdmitsItsClients(t *testing.T) {
	np := pickerNetworkPolicy(GatewayInput{Pool: "d", Spec: &kvv1.GatewaySpec{}}, nil)
	if from := np.Spec.Ingress[0].From; len(from) != 2 || from[0].PodSelector.MatchExpressions[0].Key != labelGatewayName ||
		from[1].PodSelector.MatchExpressions[0].Key != labelEnvoyGatewayName || from[0].NamespaceSelector == nil {
		t.Errorf("default clients %+v", from)
	}
	if !admits(np.Spec.Ingress[0], EPPPort) || admits(np.Spec.Ingress[0], EPPAdminPort) || len(np.Spec.Ingress[1].From) != 0 || !admits(np.Spec.Ingress[1], EPPAdminPort) {
		t.Errorf("rules %+v", np.Spec.Ingress)
	}
	lb := []kvv1.PickerClient{{IPBlock: &kvv1.PickerIPBlock{CIDR: "198.18.0.0/24"}}}
	np = pickerNetworkPolicy(GatewayInput{Pool: "d", Spec: &kvv1.GatewaySpec{PickerClients: lb}}, nil)
	if from := np.Spec.Ingress[0].From; len(from) != 1 || from[0].IPBlock.CIDR != "198.18.0.0/24" {
		t.Errorf("pickerClients not followed: %+v", from)
	}
}
