package cluster

import (
	"fmt"
	"os"
	"strings"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/yaml"
)

// kwokNodeAnnotation marks the nodes KWOK manages.
const kwokNodeAnnotation = "kwok.x-k8s.io/node"

// nodeDescription is the format of nodes.yaml.
type nodeDescription struct {
	InstanceTypes map[string]struct {
		Capacity map[corev1.ResourceName]string `json:"capacity"`
		Labels   map[string]string              `json:"labels"`
		Taints   []corev1.Taint                 `json:"taints"`
	} `json:"instanceTypes"`
	NodeGroups []struct {
		Name         string `json:"name"`
		InstanceType string `json:"instanceType"`
		Zone         string `json:"zone"`
		Count        int    `json:"count"`
		// Devices is who hands out the group's accelerators and EFAs: DevicePlugin (the
		// default: extended resources in capacity), or DRA drivers that publish them as
		// ResourceSlices (devices.go): kvhandoff's, or NVIDIA's, AWS's Neuron and DRANET's.
		Devices DeviceShape `json:"devices"`
		// Taints are the group's own, beside its instance type's: what only pods that ask
		// for the group may be scheduled on.
		Taints []corev1.Taint `json:"taints"`
	} `json:"nodeGroups"`
}

// Nodes reads a node description and returns the Nodes it describes, with the labels,
// taints, capacity and allocatable an EKS node of each instance type carries.
func Nodes(path string) ([]*corev1.Node, error) {
	nodes, _, err := nodesAndShapes(path)
	return nodes, err
}

// nodesAndShapes is Nodes with who hands out each node's devices.
func nodesAndShapes(path string) ([]*corev1.Node, map[string]DeviceShape, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, nil, err
	}
	var d nodeDescription
	if err := yaml.UnmarshalStrict(data, &d); err != nil {
		return nil, nil, fmt.Errorf("%s: %w", path, err)
	}
	var nodes []*corev1.Node
	shapes := map[string]DeviceShape{}
	for _, g := range d.NodeGroups {
		it, ok := d.InstanceTypes[g.InstanceType]
		if !ok {
			return nil, nil, fmt.Errorf("%s: node group %s names instance type %q, which instanceTypes does not describe", path, g.Name, g.InstanceType)
		}
		if err := g.Devices.valid(g.InstanceType); err != nil {
			return nil, nil, fmt.Errorf("%s: node group %s: %w", path, g.Name, err)
		}
		capacity := corev1.ResourceList{}
		for name, q := range it.Capacity {
			v, err := resource.ParseQuantity(q)
			if err != nil {
				return nil, nil, fmt.Errorf("%s: %s capacity %s: %w", path, g.InstanceType, name, err)
			}
			if g.Devices != DevicePlugin && deviceResource(name) {
				continue // claimed through DRA instead
			}
			capacity[name] = v
		}
		for i := range g.Count {
			name := fmt.Sprintf("%s-%d", g.Name, i)
			shapes[name] = g.Devices
			labels := map[string]string{
				"kubernetes.io/hostname":           name,
				"kubernetes.io/os":                 "linux",
				"kubernetes.io/arch":               "amd64",
				"node.kubernetes.io/instance-type": g.InstanceType,
				"topology.kubernetes.io/zone":      g.Zone,
				"topology.kubernetes.io/region":    strings.TrimRight(g.Zone, "abcdef"),
				"eks.amazonaws.com/nodegroup":      g.Name,
				"type":                             "kwok",
			}
			for k, v := range it.Labels {
				labels[k] = v
			}
			nodes = append(nodes, &corev1.Node{
				ObjectMeta: metav1.ObjectMeta{Name: name, Labels: labels, Annotations: map[string]string{kwokNodeAnnotation: "fake"}},
				Spec:       corev1.NodeSpec{Taints: append(append([]corev1.Taint(nil), it.Taints...), g.Taints...)},
				Status: corev1.NodeStatus{
					Capacity:    capacity,
					Allocatable: capacity.DeepCopy(),
					NodeInfo:    corev1.NodeSystemInfo{Architecture: "amd64", OperatingSystem: "linux", KubeletVersion: "fake"},
				},
			})
		}
	}
	return nodes, shapes, nil
}
