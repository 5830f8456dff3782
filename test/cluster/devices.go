package cluster

import (
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/dynamic-resource-allocation/deviceattribute"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/kvhandoff/kvhandoff/internal/deviceplugin/dra"
	"github.com/kvhandoff/kvhandoff/internal/deviceplugin/inventory"
	"github.com/kvhandoff/kvhandoff/internal/deviceplugin/sysfs/sysfstest"
	"github.com/kvhandoff/kvhandoff/test/envtest"
)

// DeviceShape is who hands out a simulated node's accelerators and EFAs.
type DeviceShape string

const (
	// DevicePlugin: extended resources (nvidia.com/gpu, vpc.amazonaws.com/efa) in the
	// node's capacity, as device plugins advertise them.
	DevicePlugin DeviceShape = ""
	// KvhandoffDRA: kvhandoff's DRA driver with --accelerators publishes everything, its
	// slices made by the driver's own code (dra.Devices) from the instance type's sysfs
	// fixture.
	KvhandoffDRA DeviceShape = "kvhandoff"
	// ThirdPartyDRA: NVIDIA's GPU driver (gpu.nvidia.com: gpu-<minor> with type, uuid,
	// productName, pcieBusID; NVIDIA/k8s-dra-driver-gpu cmd/gpu-kubelet-plugin/deviceinfo.go)
	// or AWS's Neuron driver (neuron.aws.com, the class EKS's docs name; its attributes are
	// not public here, so only the standard ones), and DRANET for the EFAs (dra.net:
	// dra.net/rdma, dra.net/rdmaDevice, dra.net/pciAddress, dra.net/numaNode;
	// kubernetes-sigs/dranet pkg/apis/attributes.go), each with the standard pcieRoot.
	ThirdPartyDRA DeviceShape = "thirdParty"
)

// ThirdPartyEFAClass is the class the simulated cluster installs for DRANET's EFAs
// (an installation names its own).
const ThirdPartyEFAClass = "rdma.dra.net"

func (s DeviceShape) valid(instanceType string) error {
	switch s {
	case DevicePlugin:
		return nil
	case KvhandoffDRA, ThirdPartyDRA:
		if _, ok := fixtures[instanceType]; !ok {
			return fmt.Errorf("devices %s: no sysfs fixture for %s", s, instanceType)
		}
		return nil
	}
	return fmt.Errorf("devices %q: want %q or %q (or none: device plugins)", s, KvhandoffDRA, ThirdPartyDRA)
}

// deviceResource reports whether a capacity entry is a device DRA hands out instead.
func deviceResource(name corev1.ResourceName) bool {
	return strings.HasPrefix(string(name), "nvidia.com/") || strings.HasPrefix(string(name), "aws.amazon.com/") ||
		name == "vpc.amazonaws.com/efa"
}

// fixtures are the sysfs fixtures of the instance types DRA nodes can be.
var fixtures = map[string]func() sysfstest.Fixture{
	"p5en.48xlarge": sysfstest.P5en, "p5.48xlarge": sysfstest.P5, "trn2.48xlarge": sysfstest.Trn2,
}

// Machine is an instance type's fixture as discovery sees it, and the folder holding its
// sys/: every simulated node of the type has these devices. GPUs get UUIDs of node's.
func Machine(dir, instanceType, node string) (inventory.Inventory, string, error) {
	f, ok := fixtures[instanceType]
	if !ok {
		return inventory.Inventory{}, "", fmt.Errorf("no sysfs fixture for %s", instanceType)
	}
	root := filepath.Join(dir, instanceType)
	if _, err := os.Stat(filepath.Join(root, "sys")); err != nil {
		if err := f().Write(root, filepath.Join(root, "dev")); err != nil {
			return inventory.Inventory{}, "", err
		}
	}
	inv := inventory.Discover(inventory.Options{Root: root, DevRoot: filepath.Join(root, "dev"), NVMLStatus: "disabled"})
	for i := range inv.Devices {
		if inv.Devices[i].Kind == inventory.GPU {
			inv.Devices[i].UUID = fmt.Sprintf("GPU-%s-%d", node, inv.Devices[i].Index)
		}
	}
	return inv, root, nil
}

// PublishDevices publishes what the DRA drivers of the nodes of nodesFile would (the
// nodes exist already), with the instance types' sysfs fixtures written under dir: for a
// cluster whose nodes hack/fakenodes made.
func PublishDevices(ctx context.Context, c client.Client, nodesFile, dir string) error {
	nodes, shapes, err := nodesAndShapes(nodesFile)
	if err != nil {
		return err
	}
	return publishDevices(ctx, c, nodes, shapes, dir)
}

// publishDevices installs the DeviceClasses (kvhandoff's from config/dra, the
// third-party drivers' from deviceclasses.yaml here) and the ResourceSlices of every
// node whose devices DRA hands out.
func publishDevices(ctx context.Context, c client.Client, nodes []*corev1.Node, shapes map[string]DeviceShape, dir string) error {
	for _, f := range []string{filepath.Join(envtest.RepoRoot(), "config", "dra", "deviceclasses.yaml"),
		filepath.Join(envtest.RepoRoot(), "test", "cluster", "deviceclasses.yaml")} {
		if err := createAll(ctx, c, f); err != nil {
			return err
		}
	}
	for _, n := range nodes {
		shape := shapes[n.Name]
		if shape == DevicePlugin {
			continue
		}
		inv, root, err := Machine(dir, n.Labels["node.kubernetes.io/instance-type"], n.Name)
		if err != nil {
			return err
		}
		sliceSet, err := Slices(shape, n.Name, inv, filepath.Join(root, "sys"))
		if err != nil {
			return err
		}
		for _, s := range sliceSet {
			if err := c.Create(ctx, s); client.IgnoreAlreadyExists(err) != nil {
				return fmt.Errorf("publishing %s's %s slice: %w", n.Name, s.Spec.Driver, err)
			}
		}
	}
	return nil
}

// Slices are the ResourceSlices the drivers of shape publish for node's devices inv.
func Slices(shape DeviceShape, node string, inv inventory.Inventory, sysRoot string) ([]*resourceapi.ResourceSlice, error) {
	perDriver := map[string][]resourceapi.Device{}
	if shape == KvhandoffDRA {
		devices, problems := dra.Devices(inv, sysRoot, true, func(inventory.Device) bool { return true })
		if len(problems) > 0 {
			return nil, fmt.Errorf("%s", strings.Join(problems, "; "))
		}
		perDriver[dra.DriverName] = devices
	} else {
		for _, d := range inv.Devices {
			driver, dev := thirdParty(d)
			root, err := deviceattribute.GetPCIeRootAttributeByPCIBusID(d.PCIBusID, deviceattribute.WithFSFromRoot(sysRoot))
			if err != nil {
				return nil, err
			}
			dev.Attributes[root.Name] = root.Value
			perDriver[driver] = append(perDriver[driver], dev)
		}
	}
	var out []*resourceapi.ResourceSlice
	for _, driver := range slices.Sorted(maps.Keys(perDriver)) {
		out = append(out, &resourceapi.ResourceSlice{
			ObjectMeta: metav1.ObjectMeta{Name: node + "-" + strings.ReplaceAll(driver, ".", "-")},
			Spec: resourceapi.ResourceSliceSpec{Driver: driver, NodeName: ptr.To(node),
				Pool: resourceapi.ResourcePool{Name: node, Generation: 1, ResourceSliceCount: 1}, Devices: perDriver[driver]},
		})
	}
	return out, nil
}

// thirdParty is device d as its vendor's driver publishes it (see ThirdPartyDRA).
func thirdParty(d inventory.Device) (string, resourceapi.Device) {
	s := func(v string) resourceapi.DeviceAttribute { return resourceapi.DeviceAttribute{StringValue: ptr.To(v)} }
	switch d.Kind {
	case inventory.GPU:
		return "gpu.nvidia.com", resourceapi.Device{Name: fmt.Sprintf("gpu-%d", d.Index), Attributes: map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{
			"type": s("gpu"), "uuid": s(d.UUID), "productName": s("NVIDIA H200"), "pcieBusID": s("0000" + d.PCIBusID)}}
	case inventory.Neuron:
		return "neuron.aws.com", resourceapi.Device{Name: fmt.Sprintf("neuron-device-%d", d.Index), Attributes: map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{
			deviceattribute.StandardDeviceAttributePCIBusID: s(d.PCIBusID)}}
	default:
		return "dra.net", resourceapi.Device{Name: "pci-" + strings.NewReplacer(":", "-", ".", "-").Replace(d.PCIBusID),
			Attributes: map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{
				"dra.net/rdma": {BoolValue: ptr.To(true)}, "dra.net/rdmaDevice": s(d.RDMA), "dra.net/pciAddress": s(d.PCIBusID),
				"dra.net/pciVendor": s("Amazon.com, Inc."), "dra.net/numaNode": {IntValue: ptr.To(int64(d.NUMANode))}}}
	}
}

// createAll creates every DeviceClass of a multi-document YAML file.
func createAll(ctx context.Context, c client.Client, path string) error {
	f, err := os.Open(path)
	if err != nil {
		return err
	}
	defer f.Close()
	dec := yaml.NewYAMLOrJSONDecoder(f, 4096)
	for {
		var dc resourceapi.DeviceClass
		if err := dec.Decode(&dc); err != nil {
			if errors.Is(err, io.EOF) {
				return nil
			}
			return fmt.Errorf("%s: %w", path, err)
		}
		if err := c.Create(ctx, &dc); client.IgnoreAlreadyExists(err) != nil {
			return fmt.Errorf("%s: DeviceClass %s: %w", path, dc.Name, err)
		}
	}
}
