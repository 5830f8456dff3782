package render

import (
	"encoding/json"
	"fmt"
	pathpkg "path"
	"slices"
	"sort"
	"strings"

	corev1 "k8s.io/api/core/v1"
)

// What a pool's spec.template may set. Engine pods need hostPath volumes (the agent's
// sockets, the host's EFA libfabric), so their namespace's Pod
// Security Admission level must be privileged and stops nothing: whoever may write a
// pool could, through an open template, run a privileged pod with the host's / mounted.
// So the template is an allow-list, checked on what the user wrote, before the merge:
//
//   - metadata: labels and annotations kvhandoff does not set;
//   - spec: scheduling (nodeSelector keys kvhandoff does not set, affinity, tolerations,
//     topologySpreadConstraints, priorityClassName, schedulerName, runtimeClassName,
//     preemptionPolicy), the service account, image pull secrets, DNS, the grace
//     period, readiness gates, the pod securityContext's fsGroup,
//     fsGroupChangePolicy and seccompProfile, and volumes of the kinds Pod Security's
//     restricted level allows under names kvhandoff does not use;
//   - the engine container: resources other than the accelerators, NICs and hugepages
//     kvhandoff requests, env it does not set, mounts of the template's volumes at
//     paths it does not use, ports, probes, lifecycle hooks, pull policy, working
//     folder and termination message settings — never its image (spec.image is what
//     runs: the vLLM version check and the compat-hash read it), command, args or
//     securityContext;
//   - other containers and init containers (sidecars): anything a container may set
//     except accelerator, NIC or hugepage resources, mounts of kvhandoff's volumes, and
//     a securityContext that does more than tighten (runAsNonRoot: true,
//     allowPrivilegeEscalation: false, readOnlyRootFilesystem, capabilities.drop,
//     seccompProfile RuntimeDefault); kvhandoff's own init container is not theirs.
//
// Within those, what Pod Security's baseline level refuses is refused too, so that a
// template adds nothing baseline would not let a pod do (the engine pod's own exceptions,
// its hostPath sockets and IPC_LOCK, are kvhandoff's): host ports, probe and hook hosts,
// an Unconfined seccomp or AppArmor profile, system- priority classes, and fsGroup 0. And
// nothing may run code in the engine container other than vLLM with kvhandoff's
// connector: no exec probes or hooks, no variables that load code (loaderEnv), no mounts
// over or under kvhandoff's (paths compared cleaned).
//
// Strategic-merge directives ("$patch", "$retainKeys", …) are refused: they delete or
// replace what kvhandoff rendered.

var (
	templateMetadata = keys("labels", "annotations")
	templateSpec     = keys("nodeSelector", "affinity", "tolerations", "topologySpreadConstraints", "priorityClassName", "schedulerName",
		"runtimeClassName", "preemptionPolicy", "serviceAccountName", "imagePullSecrets", "dnsPolicy", "dnsConfig",
		"terminationGracePeriodSeconds", "readinessGates", "securityContext", "volumes", "containers", "initContainers")
	templatePodSecurity = keys("fsGroup", "fsGroupChangePolicy", "seccompProfile")
	// Pod Security's restricted level: volumes that reach nothing of the host.
	templateVolumeKinds = keys("configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected", "secret")
	templateEngine      = keys("name", "resources", "env", "volumeMounts", "ports", "livenessProbe", "readinessProbe", "startupProbe",
		"lifecycle", "imagePullPolicy", "workingDir", "terminationMessagePath", "terminationMessagePolicy")
	templateSidecar = keys("name", "image", "command", "args", "env", "envFrom", "resources", "volumeMounts", "ports", "livenessProbe",
		"readinessProbe", "startupProbe", "lifecycle", "imagePullPolicy", "workingDir", "terminationMessagePath",
		"terminationMessagePolicy", "securityContext", "restartPolicy", "stdin", "stdinOnce", "tty")
	templateContainerSecurity = keys("runAsNonRoot", "allowPrivilegeEscalation", "readOnlyRootFilesystem", "capabilities", "seccompProfile")
	templatePort              = keys("name", "containerPort", "protocol")
	// loaderEnv are variables that make the engine's process load code of their choosing
	// (the template's env and the pool's spec.env alike).
	loaderEnv = keys("LD_PRELOAD", "LD_LIBRARY_PATH", "LD_AUDIT", "PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PYTHONUSERBASE",
		"PYTHONINSPECT", "BASH_ENV", "ENV")
)

// appArmorAnnotation is the prefix of the pod annotations that set a container's
// AppArmor profile (before securityContext.appArmorProfile).
const appArmorAnnotation = "container.apparmor.security.beta.kubernetes.io/"

// engineHints say why the engine container's owned fields are not the template's.
var engineHints = map[string]string{
	"image":           "spec.image is what runs (the vLLM version check and the compat-hash read it)",
	"command":         "kvhandoff runs vllm serve; use spec.engineArgs for extra arguments",
	"args":            "they carry the pool's parallelism and its --kv-transfer-config; use spec.engineArgs for extra arguments",
	"securityContext": "kvhandoff sets it from the policy (IPC_LOCK, or fabric.privileged) and the pool's runAsRoot",
}

func keys(ks ...string) map[string]bool {
	m := make(map[string]bool, len(ks))
	for _, k := range ks {
		m[k] = true
	}
	return m
}

// templateChecker checks a template against the pod kvhandoff rendered.
type templateChecker struct {
	rendered *corev1.PodTemplateSpec
	errs     []string
}

// checkTemplate returns what the template sets that it may not, one line per field.
func checkTemplate(raw []byte, rendered *corev1.PodTemplateSpec) error {
	var doc map[string]any
	if err := json.Unmarshal(raw, &doc); err != nil {
		return &TemplateError{fmt.Sprintf("spec.template is not a JSON object: %v", err)}
	}
	c := &templateChecker{rendered: rendered}
	c.object("spec.template", doc, keys("metadata", "spec"), func(k string, v any, path string) {
		switch k {
		case "metadata":
			c.object(path, v, templateMetadata, func(k string, v any, path string) {
				owned := rendered.Labels
				if k == "annotations" {
					owned = rendered.Annotations
					c.appArmor(path, v)
				}
				c.mapKeys(path, v, owned)
			})
		case "spec":
			c.spec(path, v)
		}
	})
	if len(c.errs) == 0 {
		return nil
	}
	return &TemplateError{strings.Join(c.errs, "; ")}
}

func (c *templateChecker) refuse(path, format string, args ...any) {
	c.errs = append(c.errs, path+": "+fmt.Sprintf(format, args...))
}

// object checks that v is an object whose keys are allowed, and hands each to each.
func (c *templateChecker) object(path string, v any, allowed map[string]bool, each func(k string, v any, path string)) {
	m, ok := v.(map[string]any)
	if !ok {
		if v != nil {
			c.refuse(path, "must be an object")
		}
		return
	}
	for _, k := range sortedKeys(m) {
		p := path + "." + k
		switch {
		case strings.HasPrefix(k, "$"):
			c.refuse(p, "strategic-merge directives are not allowed: they delete or replace what kvhandoff renders")
		case !allowed[k]:
			c.refuse(p, "not allowed (a template may set %s here)", strings.Join(sortedKeys(allowed), ", "))
		case each != nil:
			each(k, m[k], p)
		}
	}
}

// mapKeys refuses keys of a string map that kvhandoff sets (labels, selectors).
func (c *templateChecker) mapKeys(path string, v any, owned map[string]string) {
	m, _ := v.(map[string]any)
	for _, k := range sortedKeys(m) {
		if strings.HasPrefix(k, "$") {
			c.refuse(path+"["+k+"]", "strategic-merge directives are not allowed: they delete or replace what kvhandoff renders")
		} else if _, ok := owned[k]; ok || strings.HasPrefix(k, "kvhandoff.io/") {
			c.refuse(path+"["+k+"]", "set by kvhandoff")
		}
	}
}

func (c *templateChecker) spec(path string, v any) {
	r := c.rendered.Spec
	volumes := map[string]bool{}
	for _, vol := range r.Volumes {
		volumes[vol.Name] = true
	}
	c.object(path, v, templateSpec, func(k string, v any, path string) {
		switch k {
		case "nodeSelector":
			c.mapKeys(path, v, r.NodeSelector)
		case "terminationGracePeriodSeconds":
			// The drain hook waits for what the engine holds; the grace period is what
			// ends a pod whose engine never empties (a node drain waits for it).
			if n, ok := v.(float64); ok && (n < 0 || n > MaxTerminationGraceSeconds) {
				c.refuse(path, "%.0f: must be 0 to %d (an hour: a node drain waits this long for the engine)", n, MaxTerminationGraceSeconds)
			}
		case "priorityClassName":
			if name, _ := v.(string); strings.HasPrefix(name, "system-") {
				c.refuse(path, "%s is for the cluster's own components: an engine with it preempts them and is evicted last", name)
			}
		case "securityContext":
			c.object(path, v, templatePodSecurity, func(k string, v any, path string) {
				switch k {
				case "fsGroup":
					if n, ok := v.(float64); ok && n == 0 {
						c.refuse(path, "may not be 0 (root's group would own the pod's volumes)")
					}
				case "seccompProfile":
					c.seccomp(path, v)
				}
			})
		case "volumes":
			c.list(path, v, func(path, name string, item map[string]any) {
				if volumes[name] {
					c.refuse(path, "volume %q is kvhandoff's", name)
					return
				}
				kinds := map[string]bool{"name": true}
				for k := range templateVolumeKinds {
					kinds[k] = true
				}
				c.object(path, item, kinds, nil)
			})
		case "containers", "initContainers":
			c.list(path, v, func(path, name string, item map[string]any) {
				switch {
				case k == "containers" && name == EngineContainer:
					c.engine(path, item, volumes)
				case slices.ContainsFunc(append(r.Containers, r.InitContainers...), func(x corev1.Container) bool { return x.Name == name }):
					c.refuse(path, "container %q is kvhandoff's", name)
				default:
					c.sidecar(path, item, volumes)
				}
			})
		}
	})
}

// list checks a list of named objects, handing each to each with its path.
func (c *templateChecker) list(path string, v any, each func(path, name string, item map[string]any)) {
	items, ok := v.([]any)
	if !ok {
		c.refuse(path, "must be a list")
		return
	}
	for i, it := range items {
		item, ok := it.(map[string]any)
		name, _ := item["name"].(string)
		p := fmt.Sprintf("%s[%d]", path, i)
		if !ok || name == "" {
			c.refuse(p, "must be an object with a name")
			continue
		}
		each(p, name, item)
	}
}

func (c *templateChecker) engine(path string, item map[string]any, volumes map[string]bool) {
	var engine corev1.Container
	for _, x := range c.rendered.Spec.Containers {
		if x.Name == EngineContainer {
			engine = x
		}
	}
	for _, k := range sortedKeys(item) {
		if hint, ok := engineHints[k]; ok {
			c.refuse(path+"."+k, "the engine container's %s is not the template's: %s", k, hint)
			delete(item, k)
		}
	}
	c.object(path, item, templateEngine, func(k string, v any, path string) {
		switch k {
		case "resources":
			c.resources(path, v)
		case "env":
			c.list(path, v, func(path, name string, _ map[string]any) {
				switch {
				case slices.ContainsFunc(engine.Env, func(e corev1.EnvVar) bool { return e.Name == name }):
					c.refuse(path, "%s is set by kvhandoff (the engine's identity, fabric and connector; spec.env sets the others)", name)
				case loaderEnv[name]:
					c.refuse(path, "%s would load code of its choosing into the engine", name)
				}
			})
		case "volumeMounts":
			c.mounts(path, v, volumes, engine.VolumeMounts)
		case "ports":
			c.ports(path, v)
		case "livenessProbe", "readinessProbe", "startupProbe":
			c.handler(path, v, keys("exec"))
		case "lifecycle":
			c.object(path, v, keys("postStart", "preStop", "stopSignal"), func(k string, v any, path string) {
				if k != "stopSignal" {
					c.handler(path, v, keys("exec"))
				}
			})
		}
	})
}

// handler checks a probe or a lifecycle hook: no host of its own (baseline), and none of
// the handler kinds in refused.
func (c *templateChecker) handler(path string, v any, refused map[string]bool) {
	m, ok := v.(map[string]any)
	if !ok {
		return
	}
	for _, k := range sortedKeys(m) {
		switch {
		case refused[k]:
			c.refuse(path+"."+k, "not allowed in the engine container: it would run a command there, which only kvhandoff sets")
		case k == "httpGet" || k == "tcpSocket":
			if h, _ := m[k].(map[string]any); h != nil && h["host"] != nil {
				c.refuse(path+"."+k+".host", "not allowed: a probe checks its own pod")
			}
		}
	}
}

// ports allows a container's own ports, never the node's (hostPort, hostIP).
func (c *templateChecker) ports(path string, v any) {
	items, ok := v.([]any)
	if !ok {
		c.refuse(path, "must be a list")
		return
	}
	for i, it := range items {
		c.object(fmt.Sprintf("%s[%d]", path, i), it, templatePort, nil)
	}
}

// seccomp allows the runtime's default profile and profiles on the node, never none.
func (c *templateChecker) seccomp(path string, v any) {
	if m, _ := v.(map[string]any); m == nil || (m["type"] != string(corev1.SeccompProfileTypeRuntimeDefault) && m["type"] != string(corev1.SeccompProfileTypeLocalhost)) {
		c.refuse(path, "may only be {type: RuntimeDefault} or {type: Localhost, ...}")
	}
}

// appArmor refuses AppArmor annotations that lift the profile.
func (c *templateChecker) appArmor(path string, v any) {
	m, _ := v.(map[string]any)
	for _, k := range sortedKeys(m) {
		if val, _ := m[k].(string); strings.HasPrefix(k, appArmorAnnotation) && val != "runtime/default" && !strings.HasPrefix(val, "localhost/") {
			c.refuse(path+"["+k+"]", "may only be runtime/default or localhost/<profile>")
		}
	}
}

func (c *templateChecker) sidecar(path string, item map[string]any, volumes map[string]bool) {
	c.object(path, item, templateSidecar, func(k string, v any, path string) {
		switch k {
		case "resources":
			c.resources(path, v)
		case "volumeMounts":
			c.mounts(path, v, volumes, nil)
		case "ports":
			c.ports(path, v)
		case "livenessProbe", "readinessProbe", "startupProbe":
			c.handler(path, v, nil)
		case "lifecycle":
			c.object(path, v, keys("postStart", "preStop", "stopSignal"), func(k string, v any, path string) {
				if k != "stopSignal" {
					c.handler(path, v, nil)
				}
			})
		case "securityContext":
			c.object(path, v, templateContainerSecurity, func(k string, v any, path string) {
				switch k {
				case "runAsNonRoot":
					if v != true {
						c.refuse(path, "may only be true")
					}
				case "allowPrivilegeEscalation":
					if v != false {
						c.refuse(path, "may only be false")
					}
				case "capabilities":
					c.object(path, v, keys("drop"), nil)
				case "seccompProfile":
					if m, _ := v.(map[string]any); len(m) != 1 || m["type"] != string(corev1.SeccompProfileTypeRuntimeDefault) {
						c.refuse(path, "may only be {type: RuntimeDefault}")
					}
				}
			})
		}
	})
}

// resources refuses what kvhandoff requests for the engine: accelerators, NICs and
// hugepages are counted for the pool, and no sidecar may take them.
func (c *templateChecker) resources(path string, v any) {
	owned := map[string]bool{string(ResourceNvidiaGPU): true, string(ResourceNeuron): true, string(ResourceEFA): true}
	c.object(path, v, keys("requests", "limits", "claims"), func(k string, v any, path string) {
		if k == "claims" {
			c.refuse(path, "resource claims are not allowed: devices come from the pool's accelerator and policy")
			return
		}
		m, _ := v.(map[string]any)
		for _, name := range sortedKeys(m) {
			if owned[name] || strings.HasPrefix(name, corev1.ResourceHugePagesPrefix) || strings.HasPrefix(name, "aws.amazon.com/neuron") ||
				strings.HasPrefix(name, "kvhandoff.io/") {
				c.refuse(path+"["+name+"]", "set by kvhandoff from the pool's accelerator and policy")
			}
		}
	})
}

// mounts refuses mounts of kvhandoff's volumes, and at, over or inside the paths of its
// mounts (compared cleaned: "/var/run/kvhandoff/" is "/var/run/kvhandoff").
func (c *templateChecker) mounts(path string, v any, volumes map[string]bool, rendered []corev1.VolumeMount) {
	c.list(path, v, func(path, name string, item map[string]any) {
		at, _ := item["mountPath"].(string)
		at = pathpkg.Clean("/" + at)
		if volumes[name] {
			c.refuse(path, "volume %q is kvhandoff's", name)
			return
		}
		for _, r := range rendered {
			if nested(at, r.MountPath) || nested(r.MountPath, at) {
				c.refuse(path, "%s is where kvhandoff mounts a volume, or over or inside one (%s)", at, r.MountPath)
				return
			}
		}
	})
}

// nested reports whether path a is b or inside it.
func nested(a, b string) bool {
	return a == b || strings.HasPrefix(a, strings.TrimSuffix(b, "/")+"/")
}

func sortedKeys[V any](m map[string]V) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}
