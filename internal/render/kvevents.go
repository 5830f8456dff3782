package render

import (
	"encoding/json"
	"fmt"
	"strings"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/utils/ptr"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
)

const (
	// KVEventsPort is where an engine pod's kv-events sidecar serves the keys of the
	// blocks its engine holds (routing prefixSource KVEvents), to routers and pickers.
	KVEventsPort = 8102
	// KVEventsEndpoint is where vLLM's KV events publisher connects: the sidecar's
	// listener on the pod's own loopback. The events carry every prompt's token ids, so
	// they never leave the pod; only keys of blocks do.
	KVEventsEndpoint = "tcp://127.0.0.1:5557"
	kvEventsTopic    = "kv"
	// KVEventsTokenKey is the key of the token in a KVEventsSecret.
	KVEventsTokenKey = "token"
	// kvEventsTokenDir is where the token is mounted in the sidecars, routers and pickers.
	kvEventsTokenDir  = "/var/run/kvhandoff/kv-events"
	kvEventsTokenFile = kvEventsTokenDir + "/" + KVEventsTokenKey
)

// KVEventsSecret is the Secret of the token that the kv-events sidecars of a PrefillPool's
// engines, and of the DecodePools' engines that pair with it, ask of every follower: the
// routers and endpoint pickers of those DecodePools hold it, nothing else does. The keys
// say which prompts an engine holds, to whoever can guess a prompt (and its salt).
func KVEventsSecret(prefillPool string) string { return prefillPool + "-kv-events" }

// kvEventsTokenVolume mounts a KVEventsSecret's token alone.
func kvEventsTokenVolume(secret string) (corev1.Volume, corev1.VolumeMount) {
	return corev1.Volume{Name: "kv-events-token", VolumeSource: corev1.VolumeSource{Secret: &corev1.SecretVolumeSource{
			SecretName: secret, Items: []corev1.KeyToPath{{Key: KVEventsTokenKey, Path: KVEventsTokenKey}}, DefaultMode: ptr.To[int32](0o440)}}},
		corev1.VolumeMount{Name: "kv-events-token", MountPath: kvEventsTokenDir, ReadOnly: true}
}

// kvEventsConfig is vLLM's --kv-events-config: publish over ZeroMQ to the sidecar.
func kvEventsConfig() string {
	b, _ := json.Marshal(map[string]any{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": KVEventsEndpoint, "topic": kvEventsTopic})
	return string(b)
}

// kvEventsSidecar is the native sidecar that follows the engine's KV events and serves
// the keys of the blocks it holds (the router image's /kv-events). It starts before
// the engine, so no event is published before it listens.
func kvEventsSidecar(in Input) corev1.Container {
	_, mount := kvEventsTokenVolume("")
	return corev1.Container{
		Name:          "kv-events",
		Image:         in.KVEventsImage,
		RestartPolicy: ptr.To(corev1.ContainerRestartPolicyAlways),
		Command:       []string{"/kv-events"},
		Args: []string{"--served-model=" + servedModel(in.Spec), "--kv-events-endpoint=" + KVEventsEndpoint,
			"--kv-events-topic=" + kvEventsTopic, fmt.Sprintf("--engine=127.0.0.1:%d", HTTPPort), fmt.Sprintf("--listen=:%d", KVEventsPort),
			"--token-file=" + kvEventsTokenFile},
		Env:            []corev1.EnvVar{goMemLimit()},
		Ports:          []corev1.ContainerPort{{Name: "kv-events", ContainerPort: KVEventsPort, Protocol: corev1.ProtocolTCP}},
		ReadinessProbe: namedPortProbe("/healthz", "kv-events", 5, 2),
		LivenessProbe:  namedPortProbe("/healthz", "kv-events", 10, 3),
		Resources: corev1.ResourceRequirements{
			// About 60 bytes a block held: 4M blocks (a large H200 cache at block 16) is 256 MB.
			Requests: corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("50m"), corev1.ResourceMemory: resource.MustParse("64Mi")},
			Limits:   corev1.ResourceList{corev1.ResourceMemory: resource.MustParse("512Mi")},
		},
		SecurityContext: restrictedContainer(),
		VolumeMounts:    []corev1.VolumeMount{mount},
	}
}

// servedModel is the model name requests give the engine: the first of
// --served-model-name in its engine args, else the model.
func servedModel(spec *kvv1.EngineSpec) string {
	args := spec.EngineArgs
	for i, a := range args {
		if v, ok := strings.CutPrefix(a, "--served-model-name="); ok && strings.TrimSpace(v) != "" {
			return strings.Fields(v)[0]
		}
		if a == "--served-model-name" && i+1 < len(args) && !strings.HasPrefix(args[i+1], "--") {
			return args[i+1]
		}
	}
	return spec.Model
}
