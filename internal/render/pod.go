package render

import (
	"fmt"
	"hash/fnv"
	"strconv"

	corev1 "k8s.io/api/core/v1"
	resourcev1 "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/utils/ptr"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
	"github.com/kvhandoff/kvhandoff/internal/compat"
	"github.com/kvhandoff/kvhandoff/internal/instancetype"
)

// Resource names and host paths the engines use.
const (
	ResourceNvidiaGPU = corev1.ResourceName("nvidia.com/gpu")
	ResourceNeuron    = corev1.ResourceName("aws.amazon.com/neuron")
	ResourceEFA       = corev1.ResourceName("vpc.amazonaws.com/efa")

	// EFAHostDir is where the AWS EFA installer puts the host's libfabric; engines load it
	// from there so the node's EFA driver and libfabric always match.
	EFAHostDir = "/opt/amazon/efa"
	// AgentSocketDir holds the transfer agent's socket on every node that runs one.
	AgentSocketDir = "/var/run/kvhandoff"
	// AgentSocket is the agent's socket inside AgentSocketDir.
	AgentSocket = AgentSocketDir + "/agent.sock"
	// AgentPeerPort is where the transfer agents reach each other (config/agent): an
	// executor-Agent engine's KV side channel is its node's agent at this port.
	AgentPeerPort = 7470
	// ConnectorDir is where the connector init container puts kvhandoff's vLLM connector
	// (an emptyDir on the engine's PYTHONPATH).
	ConnectorDir = "/opt/kvhandoff/python"
	// AgentGroup owns the agent's sockets and their folder (config/agent passes it as
	// --socket-gid); engine pods of executor Agent get it as a supplemental group, so they
	// reach the agent without running as root.
	AgentGroup = 7470
	// DrainHook is the engine container's preStop hook (executor Agent): the connector
	// init container's own binary, copied beside the connector, which returns once the
	// engine has nothing in flight (package drain).
	DrainHook = ConnectorDir + "/kvhandoff-drain"
	// RunDir is a small writable emptyDir of the engine container where the connector
	// keeps HeldFile, its count of requests whose blocks are held for a transfer, which
	// the drain hook reads (KVHANDOFF_HELD_FILE).
	RunDir   = "/run/kvhandoff"
	HeldFile = RunDir + "/held"
	// EngineTerminationGraceSeconds bounds a terminating engine's drain: its longest
	// answers (a decode leg may stream for minutes) finish within it.
	EngineTerminationGraceSeconds = 600
	// MaxTerminationGraceSeconds is the longest grace a pool's template may give.
	MaxTerminationGraceSeconds = 3600
	// engineHome is HOME for engines that do not run as root: a folder they can write,
	// as the images' own home belongs to root.
	engineHome = "/tmp/home"

	labelInstanceType = "node.kubernetes.io/instance-type"
	labelZone         = "topology.kubernetes.io/zone"
	labelHostname     = "kubernetes.io/hostname"
)

// podTemplate assembles an engine pod: the engine container and the pod around it,
// then what the EFA fabric, the Agent executor, a gateway's leg runner and KV events add,
// then the pool's own template over all of it.
// claims are the pool's ResourceClaimTemplates under allocation DRA.
func podTemplate(in Input, claims []*resourcev1.ResourceClaimTemplate) (*corev1.PodTemplateSpec, error) {
	hash, err := policyHash(in.Policy)
	if err != nil {
		return nil, err
	}
	engine, err := engineContainer(in)
	if err != nil {
		return nil, err
	}
	pod := &corev1.PodTemplateSpec{
		ObjectMeta: metav1.ObjectMeta{Labels: podLabels(in), Annotations: map[string]string{kvv1.AnnotationPolicyHash: hash}},
		Spec: corev1.PodSpec{
			Volumes: []corev1.Volume{{
				// NCCL and vLLM's workers exchange tensors through /dev/shm; the container
				// runtime's 64 MiB default is far too small.
				Name:         "shm",
				VolumeSource: corev1.VolumeSource{EmptyDir: &corev1.EmptyDirVolumeSource{Medium: corev1.StorageMediumMemory}},
			}},
			SecurityContext:               podSecurity(in),
			NodeSelector:                  nodeSelector(in),
			Tolerations:                   tolerations(in.Spec.Accelerator.Type),
			Affinity:                      affinity(in),
			TerminationGracePeriodSeconds: ptr.To[int64](EngineTerminationGraceSeconds),
			// A Service named like vLLM's own variables (a "vllm" Service sets VLLM_PORT)
			// breaks vLLM's configuration; engines find peers through kvhandoff, not links.
			EnableServiceLinks: ptr.To(false),
		},
	}
	if in.Policy.Fabric.Provider == kvv1.ProviderEFA {
		engine.VolumeMounts = append(engine.VolumeMounts, corev1.VolumeMount{Name: "efa", MountPath: EFAHostDir, ReadOnly: true})
		pod.Spec.Volumes = append(pod.Spec.Volumes, hostPathVolume("efa", EFAHostDir))
	}
	addDeviceClaims(pod, &engine, claims)
	if in.Policy.Executor == kvv1.ExecutorAgent {
		addAgentExecutor(in, pod, &engine)
	}
	if in.LegRunnerImage != "" {
		addLegRunner(in, pod)
	}
	if in.KVEventsImage != "" {
		addKVEvents(in, pod)
	}
	pod.Spec.Containers = []corev1.Container{engine}
	return mergeTemplate(pod, in.Spec.Template)
}

// podLabels are the pool's, and what each engine runs: its compat-hash and sizes (a
// rollout mixes pods of two).
func podLabels(in Input) map[string]string {
	labels := objectMeta(in).Labels
	labels[kvv1.LabelCompatHash] = compat.Hash(in.Spec, in.Policy, compat.KVLayout(in.Spec, in.PeerTensorParallelSize))
	labels[kvv1.LabelTensorParallelSize] = strconv.Itoa(int(in.Spec.TensorParallelSize))
	labels[kvv1.LabelPipelineParallelSize] = strconv.Itoa(int(in.Spec.PipelineParallelSize))
	return labels
}

// policyHash is the hash of what of the policy engines run: a change rolls them.
func policyHash(policy *kvv1.KVTransferPolicySpec) (string, error) {
	// sameNode at its default is left out of the hash, so the release that added the field
	// rolls no engine whose policy does not set it (omitempty does that for the others).
	hashed := *policy
	if hashed.SameNode == kvv1.SameNodeForbid {
		hashed.SameNode = ""
	}
	// The router carries out handoffFailurePolicy, its limit and routing; engines never
	// see them.
	hashed.HandoffFailurePolicy, hashed.HandoffFailureLimitPercent, hashed.HealthWindowSeconds, hashed.Routing = "", nil, nil, nil
	return hashJSON(&hashed)
}

func engineContainer(in Input) (corev1.Container, error) {
	resources, err := resourcesFor(in)
	if err != nil {
		return corev1.Container{}, err
	}
	return corev1.Container{
		Name:    EngineContainer,
		Image:   in.Spec.Image,
		Command: []string{"vllm", "serve"},
		Args:    args(in),
		Env:     mergeEnv(mergeEnv(env(in), homeEnv(in)), in.Spec.Env),
		Ports: []corev1.ContainerPort{
			{Name: "http", ContainerPort: HTTPPort, Protocol: corev1.ProtocolTCP},
			{Name: "nixl", ContainerPort: SideChannelPort, Protocol: corev1.ProtocolTCP},
		},
		Resources: resources,
		// Loading a 32B model takes minutes (weights download, CUDA graphs): allow up to
		// 30 minutes before the first successful probe, then watch closely.
		StartupProbe:    httpProbe("/v1/models", 10, 180),
		ReadinessProbe:  httpProbe("/v1/models", 10, 3),
		LivenessProbe:   httpProbe("/health", 15, 4),
		SecurityContext: securityContext(in.Policy),
		VolumeMounts:    []corev1.VolumeMount{{Name: "shm", MountPath: "/dev/shm"}},
	}, nil
}

// podSecurity runs engines as a uid of their pool's own under either executor (stock
// vLLM images run as root, beside EFA devices and, with the agent, the node's shared
// sockets), and executor-Agent engines in the agent's socket group.
func podSecurity(in Input) *corev1.PodSecurityContext {
	var sc *corev1.PodSecurityContext
	if in.Policy.Executor == kvv1.ExecutorAgent {
		sc = &corev1.PodSecurityContext{SupplementalGroups: []int64{AgentGroup}}
	}
	if !in.Spec.RunAsRoot {
		if sc == nil {
			sc = &corev1.PodSecurityContext{}
		}
		sc.RunAsNonRoot, sc.RunAsUser = ptr.To(true), ptr.To(EngineUser(in.Namespace, in.Name, in.Role))
	}
	return sc
}

// addAgentExecutor gives an executor-Agent engine the node's agent sockets, the
// connector (copied in by an init container) and the drain hook.
func addAgentExecutor(in Input, pod *corev1.PodTemplateSpec, engine *corev1.Container) {
	pod.Labels[kvv1.LabelExecutor] = string(kvv1.ExecutorAgent)
	// Read-only: connecting to a socket needs no write access, and nothing an engine
	// does can then replace or add anything where every engine of the node connects.
	engine.VolumeMounts = append(engine.VolumeMounts,
		corev1.VolumeMount{Name: "kvhandoff-agent", MountPath: AgentSocketDir, ReadOnly: true},
		corev1.VolumeMount{Name: "kvhandoff-connector", MountPath: ConnectorDir, ReadOnly: true},
		corev1.VolumeMount{Name: "kvhandoff-run", MountPath: RunDir})
	pod.Spec.Volumes = append(pod.Spec.Volumes, hostPathVolume("kvhandoff-agent", AgentSocketDir),
		corev1.Volume{Name: "kvhandoff-connector", VolumeSource: corev1.VolumeSource{EmptyDir: &corev1.EmptyDirVolumeSource{}}},
		corev1.Volume{Name: "kvhandoff-run",
			VolumeSource: corev1.VolumeSource{EmptyDir: &corev1.EmptyDirVolumeSource{Medium: corev1.StorageMediumMemory, SizeLimit: ptr.To(resource.MustParse("1Mi"))}}})
	pod.Spec.InitContainers = append(pod.Spec.InitContainers, connectorInit(in))
	// Deleted (scaled down, drained, rolled), the engine stops only once it has
	// finished what it serves and the transfers its blocks are held for: routers stop
	// choosing a terminating pod, so it empties.
	engine.Lifecycle = &corev1.Lifecycle{PreStop: &corev1.LifecycleHandler{Exec: &corev1.ExecAction{
		Command: []string{DrainHook, fmt.Sprintf("--metrics=http://127.0.0.1:%d/metrics", HTTPPort), "--held=" + HeldFile}}}}
}

// addLegRunner adds a gateway's leg runner, running as the leg runners' account.
func addLegRunner(in Input, pod *corev1.PodTemplateSpec) {
	pod.Spec.InitContainers = append(pod.Spec.InitContainers, legRunner(in))
	pod.Spec.Volumes = append(pod.Spec.Volumes, legRunnerToken())
	// The leg runner follows the pools through the API; the engine gets no token
	// (legRunnerToken mounts one into the sidecar alone).
	pod.Spec.ServiceAccountName = LegRunnerName(in.Name)
	// Its deprecated alias too, or the API server would copy it back into
	// serviceAccountName when the gateway goes and the apply drops the name.
	pod.Spec.DeprecatedServiceAccount = pod.Spec.ServiceAccountName
	pod.Spec.AutomountServiceAccountToken = ptr.To(false)
}

// addKVEvents adds the kv-events sidecar and the PrefillPool's token it checks.
func addKVEvents(in Input, pod *corev1.PodTemplateSpec) {
	pod.Spec.InitContainers = append(pod.Spec.InitContainers, kvEventsSidecar(in))
	prefill := in.PrefillPool
	if in.Role == kvv1.RolePrefill {
		prefill = in.Name
	}
	v, _ := kvEventsTokenVolume(KVEventsSecret(prefill))
	pod.Spec.Volumes = append(pod.Spec.Volumes, v)
	pod.Labels[kvv1.LabelKVEventsPort] = strconv.Itoa(KVEventsPort)
}

func args(in Input) []string {
	a := []string{
		in.Spec.Model,
		"--tensor-parallel-size", strconv.Itoa(int(in.Spec.TensorParallelSize)),
		"--pipeline-parallel-size", strconv.Itoa(int(in.Spec.PipelineParallelSize)),
		"--block-size", strconv.Itoa(int(in.Spec.BlockSize)),
		"--port", strconv.Itoa(HTTPPort),
		"--kv-transfer-config", KVTransferConfig(in.Role, in.Spec, in.Policy, in.PeerTensorParallelSize),
	}
	if in.KVEventsImage != "" {
		a = append(a, "--kv-events-config", kvEventsConfig())
	}
	return append(a, in.Spec.EngineArgs...)
}

func env(in Input) []corev1.EnvVar {
	e := []corev1.EnvVar{
		fieldEnv("POD_NAME", "metadata.name"),
		fieldEnv("POD_NAMESPACE", "metadata.namespace"),
		fieldEnv("VLLM_NIXL_SIDE_CHANNEL_HOST", "status.podIP"),
		{Name: "VLLM_NIXL_SIDE_CHANNEL_PORT", Value: strconv.Itoa(SideChannelPort)},
	}
	switch in.Policy.Fabric.Provider {
	case kvv1.ProviderEFA:
		e = append(e, corev1.EnvVar{Name: "FI_PROVIDER", Value: "efa"})
		if ptr.Deref(in.Policy.Fabric.GPUDirect, true) {
			e = append(e, corev1.EnvVar{Name: "FI_EFA_USE_DEVICE_RDMA", Value: "1"})
		}
		// KV must cross nodes on the NIC; libfabric's shm shortcut would hide a
		// misplacement instead of failing it.
		e = append(e, corev1.EnvVar{Name: "FI_EFA_ENABLE_SHM_TRANSFER", Value: "0"})
		// Setting LD_LIBRARY_PATH replaces the image's value, so it repeats the image's
		// accelerator library folders after the host's EFA libfabric.
		e = append(e, corev1.EnvVar{Name: "LD_LIBRARY_PATH", Value: EFAHostDir + "/lib:" + acceleratorLibraryPath(in.Spec.Accelerator.Type)})
	case kvv1.ProviderTCP:
		e = append(e, corev1.EnvVar{Name: "FI_PROVIDER", Value: "tcp"})
	case kvv1.ProviderSHM:
		e = append(e, corev1.EnvVar{Name: "FI_PROVIDER", Value: "shm"})
	}
	if layout := compat.KVLayout(in.Spec, in.PeerTensorParallelSize); layout != "" {
		e = append(e, corev1.EnvVar{Name: "VLLM_KV_CACHE_LAYOUT", Value: layout})
	}
	if in.Policy.Executor == kvv1.ExecutorAgent {
		e = append(e, corev1.EnvVar{Name: "KVHANDOFF_AGENT_SOCKET", Value: AgentSocket},
			corev1.EnvVar{Name: "KVHANDOFF_HELD_FILE", Value: HeldFile},
			// vLLM's images set no PYTHONPATH: the connector's folder is all it holds.
			corev1.EnvVar{Name: "PYTHONPATH", Value: ConnectorDir})
	}
	return e
}

// connectorInit copies kvhandoff's vLLM connector (the Dockerfile's vllm-connector
// target) into the emptyDir the engine imports it from, so stock vLLM images run it
// unchanged.
func connectorInit(in Input) corev1.Container {
	image := in.ConnectorImage
	if image == "" {
		image = DefaultConnectorImage
	}
	return corev1.Container{
		Name:    "kvhandoff-connector",
		Image:   image,
		Command: []string{"/install", ConnectorDir},
		SecurityContext: &corev1.SecurityContext{
			RunAsNonRoot: ptr.To(true), RunAsUser: ptr.To[int64](65532), AllowPrivilegeEscalation: ptr.To(false),
			ReadOnlyRootFilesystem: ptr.To(true), Capabilities: &corev1.Capabilities{Drop: []corev1.Capability{"ALL"}},
		},
		Resources: corev1.ResourceRequirements{
			Requests: corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("10m"), corev1.ResourceMemory: resource.MustParse("16Mi")},
			Limits:   corev1.ResourceList{corev1.ResourceMemory: resource.MustParse("64Mi")},
		},
		VolumeMounts: []corev1.VolumeMount{{Name: "kvhandoff-connector", MountPath: ConnectorDir}},
	}
}

// acceleratorLibraryPath is the LD_LIBRARY_PATH the vLLM images set for their accelerator.
func acceleratorLibraryPath(t kvv1.AcceleratorType) string {
	if t == kvv1.AcceleratorNeuron {
		return "/opt/aws/neuron/lib"
	}
	return "/usr/local/nvidia/lib:/usr/local/nvidia/lib64"
}

// mergeEnv applies the user's variables over the rendered ones: a variable of the same
// name replaces the rendered one in place, others are appended in the user's order.
func mergeEnv(rendered, user []corev1.EnvVar) []corev1.EnvVar {
	out := append([]corev1.EnvVar(nil), rendered...)
	index := map[string]int{}
	for i, e := range out {
		index[e.Name] = i
	}
	for _, e := range user {
		if i, ok := index[e.Name]; ok {
			out[i] = e
			continue
		}
		index[e.Name] = len(out)
		out = append(out, e)
	}
	return out
}

func resourcesFor(in Input) (corev1.ResourceRequirements, error) {
	n := compat.Accelerators(in.Spec)
	list := corev1.ResourceList{}
	// Under DRA the devices come by claim (deviceClaimTemplate), never also as extended
	// resources: two accountings of one device could hand it out twice.
	dra := usesDRA(in.Spec)
	switch {
	case dra:
	case in.Spec.Accelerator.Type == kvv1.AcceleratorNeuron:
		list[ResourceNeuron] = *resource.NewQuantity(int64(n), resource.DecimalSI)
	case in.Spec.Accelerator.Type == kvv1.AcceleratorNvidiaGPU:
		list[ResourceNvidiaGPU] = *resource.NewQuantity(int64(n), resource.DecimalSI)
	}
	// CPU engines request no device: their CPU and memory are the template's to set.
	if in.Policy.Fabric.Provider == kvv1.ProviderEFA && !dra {
		efa, err := instancetype.EFACount(n, in.Spec.InstanceType, in.Policy.Fabric.EFAPerAccelerator)
		if err != nil {
			return corev1.ResourceRequirements{}, err
		}
		list[ResourceEFA] = *resource.NewQuantity(int64(efa), resource.DecimalSI)
	}
	if hp := in.Policy.Fabric.Hugepages2Mi; hp != nil {
		list[corev1.ResourceHugePagesPrefix+"2Mi"] = *hp
		// Kubernetes accepts hugepages only together with a cpu or memory request; ask
		// for as much memory as hugepages. A template can raise it.
		list[corev1.ResourceMemory] = *hp
	}
	// Requests equal limits: accelerators, NICs and hugepages cannot be overcommitted.
	return corev1.ResourceRequirements{Limits: list, Requests: list.DeepCopy()}, nil
}

// homeEnv gives engines that run as EngineUser a HOME they can write (vLLM and its
// libraries cache there); a pool's env may set another.
func homeEnv(in Input) []corev1.EnvVar {
	if in.Spec.RunAsRoot {
		return nil
	}
	return []corev1.EnvVar{{Name: "HOME", Value: engineHome}}
}

func securityContext(policy *kvv1.KVTransferPolicySpec) *corev1.SecurityContext {
	if policy.Fabric.Privileged {
		return &corev1.SecurityContext{Privileged: ptr.To(true)}
	}
	// Registering memory with the NIC pins it; IPC_LOCK lifts the locked-memory limit.
	return &corev1.SecurityContext{Capabilities: &corev1.Capabilities{Add: []corev1.Capability{"IPC_LOCK"}}}
}

func nodeSelector(in Input) map[string]string {
	sel := map[string]string{}
	if in.Spec.InstanceType != "" {
		sel[labelInstanceType] = in.Spec.InstanceType
	}
	if in.Policy.Executor == kvv1.ExecutorAgent {
		sel[kvv1.LabelAgentReady] = "true"
	}
	if len(sel) == 0 {
		return nil
	}
	return sel
}

// tolerations let engines onto the accelerator nodes that EKS taints for them (CPU
// engines: none).
func tolerations(t kvv1.AcceleratorType) []corev1.Toleration {
	if t == kvv1.AcceleratorCPU {
		return nil
	}
	key := string(ResourceNvidiaGPU)
	if t == kvv1.AcceleratorNeuron {
		key = string(ResourceNeuron)
	}
	return []corev1.Toleration{{Key: key, Operator: corev1.TolerationOpExists, Effect: corev1.TaintEffectNoSchedule}}
}

// affinity keeps EFA pairs workable and places same-node pairs. EFA has no intra-host
// loopback, so unless the policy lets pairs share a node (their KV then moves over NVLink
// through the agent) a decode engine must not share one with a prefill engine of its pair;
// EFA does not cross availability zones, so a pool stays in one zone and decode follows
// prefill into it. sameNode: Prefer asks for decode beside prefill with any provider.
func affinity(in Input) *corev1.Affinity {
	efa := in.Policy.Fabric.Provider == kvv1.ProviderEFA
	if in.Role == kvv1.RolePrefill {
		if !efa {
			return nil
		}
		own := &metav1.LabelSelector{MatchLabels: SelectorLabels(kvv1.RolePrefill, in.Name)}
		return &corev1.Affinity{PodAffinity: &corev1.PodAffinity{
			RequiredDuringSchedulingIgnoredDuringExecution: []corev1.PodAffinityTerm{{LabelSelector: own, TopologyKey: labelZone}},
		}}
	}
	prefill := &metav1.LabelSelector{MatchLabels: SelectorLabels(kvv1.RolePrefill, in.PrefillPool)}
	a := &corev1.Affinity{}
	if efa {
		a.PodAffinity = &corev1.PodAffinity{
			RequiredDuringSchedulingIgnoredDuringExecution: []corev1.PodAffinityTerm{{LabelSelector: prefill, TopologyKey: labelZone}},
		}
	}
	switch in.Policy.SameNode {
	case kvv1.SameNodeForbid:
		if efa {
			a.PodAntiAffinity = &corev1.PodAntiAffinity{
				RequiredDuringSchedulingIgnoredDuringExecution: []corev1.PodAffinityTerm{{LabelSelector: prefill, TopologyKey: labelHostname}},
			}
		}
	case kvv1.SameNodePrefer:
		if a.PodAffinity == nil {
			a.PodAffinity = &corev1.PodAffinity{}
		}
		a.PodAffinity.PreferredDuringSchedulingIgnoredDuringExecution = []corev1.WeightedPodAffinityTerm{{
			Weight: 100, PodAffinityTerm: corev1.PodAffinityTerm{LabelSelector: prefill, TopologyKey: labelHostname},
		}}
	}
	if a.PodAffinity == nil && a.PodAntiAffinity == nil {
		return nil
	}
	return a
}

func fieldEnv(name, path string) corev1.EnvVar {
	return corev1.EnvVar{Name: name, ValueFrom: &corev1.EnvVarSource{FieldRef: &corev1.ObjectFieldSelector{FieldPath: path}}}
}

// goMemLimit is GOMEMLIMIT at the container's memory limit: a Go program's heap then
// collects its garbage before the limit (the endpoint picker held 64 MiB of bodies in 190
// MB of RSS without it, 126 MB with it), so the bounds it keeps on what it holds bound its
// memory.
func goMemLimit() corev1.EnvVar {
	return corev1.EnvVar{Name: "GOMEMLIMIT", ValueFrom: &corev1.EnvVarSource{ResourceFieldRef: &corev1.ResourceFieldSelector{Resource: "limits.memory"}}}
}

func hostPathVolume(name, path string) corev1.Volume {
	return corev1.Volume{Name: name, VolumeSource: corev1.VolumeSource{HostPath: &corev1.HostPathVolumeSource{Path: path,
		Type: ptr.To(corev1.HostPathDirectory)}}}
}

func httpProbe(path string, period, failures int32) *corev1.Probe {
	return &corev1.Probe{
		ProbeHandler:     corev1.ProbeHandler{HTTPGet: &corev1.HTTPGetAction{Path: path, Port: intstr.FromString("http")}},
		PeriodSeconds:    period,
		TimeoutSeconds:   5,
		FailureThreshold: failures,
		// Spelled out although it is the API default, so the live object equals the
		// rendered one and an unchanged pool costs no write.
		SuccessThreshold: 1,
	}
}

// EngineUser is the uid the engines of an executor-Agent pool run as unless the pool sets
// runAsRoot: one of the pool's own, from its namespace, role and name, in [2^20, 2^20+2^30),
// above the host's and images' users. Engines of different pools, other tenants' among
// them, are then never the same user: two processes of one uid can signal each other,
// read each other's /proc/PID/environ and root, and open each other's KV memfds through
// /proc/PID/fd, wherever they see each other's processes (a shared host PID namespace).
// Two pools of a thousand collide with a chance of 1 in 2,000.
func EngineUser(namespace, pool string, role kvv1.Role) int64 {
	h := fnv.New64a()
	h.Write([]byte(namespace + "/" + string(role) + "/" + pool))
	return 1<<20 + int64(h.Sum64()%(1<<30))
}
