package dra

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	resourceapi "k8s.io/api/resource/v1"
	cdispec "tags.cncf.io/container-device-interface/specs-go"

	"github.com/kvhandoff/kvhandoff/internal/deviceplugin/inventory"
)

// CDI: the kubelet hands the container runtime the CDI device IDs that Prepare returns,
// and the runtime (containerd ≥ 1.7, CRI-O) applies the edits of the spec file that
// defines them. One CDI device per claim, named by the claim's UID (never reused, so a
// runtime's cached spec cannot be stale), in a file of its own that Unprepare removes.
const (
	// CDIKind is the vendor/class of kvhandoff's CDI devices.
	CDIKind = "kvhandoff.io/claim"
	// cdiVersion is the spec version: 0.5.0 added deviceNodes' hostPath.
	cdiVersion = "0.6.0"
	// annotationDevices lists, in a spec file, the devices it prepared (pool/device,
	// comma-separated): the files are the driver's record of what is prepared, across
	// restarts.
	annotationDevices = "dra.kvhandoff.io/devices"
)

// CDIDeviceID is the qualified name of claim uid's CDI device.
func CDIDeviceID(uid string) string { return CDIKind + "=" + uid }

// Spec is the CDI spec of a claim whose devices of this driver are devices (in
// allocation order) and whose accelerators pair with EFAs as rails say: every device
// node (host nodes under devRoot), NVIDIA_VISIBLE_DEVICES or AWS_NEURON_VISIBLE_DEVICES
// for the accelerators this driver publishes, and the rails (EnvVar).
func Spec(uid string, devices []inventory.Device, keys []string, rails []Rail, devRoot string) cdispec.Spec {
	var edits cdispec.ContainerEdits
	seen := map[string]bool{}
	var gpus, neurons []string
	for _, d := range devices {
		for _, node := range d.DeviceNodes {
			if seen[node] {
				continue
			}
			seen[node] = true
			edits.DeviceNodes = append(edits.DeviceNodes, &cdispec.DeviceNode{Path: node, HostPath: filepath.Join(devRoot, strings.TrimPrefix(node, "/dev/"))})
		}
		switch d.Kind {
		case inventory.GPU:
			gpus = append(gpus, cmpOr(d.UUID, strconv.Itoa(d.Index)))
		case inventory.Neuron:
			neurons = append(neurons, strconv.Itoa(d.Index))
		}
	}
	if len(gpus) > 0 {
		edits.Env = append(edits.Env, "NVIDIA_VISIBLE_DEVICES="+strings.Join(gpus, ","))
	}
	if len(neurons) > 0 {
		edits.Env = append(edits.Env, "AWS_NEURON_VISIBLE_DEVICES="+strings.Join(neurons, ","))
	}
	if len(rails) > 0 {
		edits.Env = append(edits.Env, EnvVar(rails)+"="+Env(rails))
	}
	return cdispec.Spec{Version: cdiVersion, Kind: CDIKind, Annotations: map[string]string{annotationDevices: strings.Join(keys, ",")},
		Devices: []cdispec.Device{{Name: uid, ContainerEdits: edits}}}
}

func cmpOr(a, b string) string {
	if a != "" {
		return a
	}
	return b
}

// specFile is where claim uid's spec lives in dir.
func specFile(dir, uid string) string { return filepath.Join(dir, "kvhandoff.io-claim_"+uid+".json") }

// writeSpec writes spec atomically: a runtime never reads half a file.
func writeSpec(dir string, spec cdispec.Spec) error {
	data, err := json.Marshal(spec)
	if err != nil {
		return err
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	path := specFile(dir, spec.Devices[0].Name)
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, data, 0o644); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}

// loadPrepared reads which devices each claim's spec file in dir holds: the driver's
// record of what it prepared, also across its restarts.
func loadPrepared(dir string) (map[string]string, error) {
	files, err := filepath.Glob(filepath.Join(dir, "kvhandoff.io-claim_*.json"))
	if err != nil {
		return nil, err
	}
	held := map[string]string{}
	for _, f := range files {
		data, err := os.ReadFile(f)
		if err != nil {
			return nil, err
		}
		var spec cdispec.Spec
		if err := json.Unmarshal(data, &spec); err != nil || len(spec.Devices) != 1 {
			return nil, fmt.Errorf("%s is not a spec this driver wrote: %v", f, err)
		}
		for _, key := range strings.Split(spec.Annotations[annotationDevices], ",") {
			if key != "" {
				held[key] = spec.Devices[0].Name
			}
		}
	}
	return held, nil
}

// deviceKey identifies an allocated device within the driver.
func deviceKey(r resourceapi.DeviceRequestAllocationResult) string { return r.Pool + "/" + r.Device }

// ours lists the results of claim that are this driver's devices, without repeats.
func ours(claim *resourceapi.ResourceClaim) []resourceapi.DeviceRequestAllocationResult {
	var out []resourceapi.DeviceRequestAllocationResult
	if claim.Status.Allocation == nil {
		return nil
	}
	for _, r := range claim.Status.Allocation.Devices.Results {
		if r.Driver == DriverName && !slices.ContainsFunc(out, func(o resourceapi.DeviceRequestAllocationResult) bool {
			return deviceKey(o) == deviceKey(r)
		}) {
			out = append(out, r)
		}
	}
	return out
}
