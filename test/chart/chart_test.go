// Package chart checks the Helm chart (charts/kvhandoff) against the kustomize overlays
// of config/: the same objects, field for field, from each install path.
package chart

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"sort"
	"strings"
	"testing"

	"sigs.k8s.io/yaml"

	"github.com/kvhandoff/kvhandoff/test/envtest"
)

// onlyInKustomize are the objects config/ makes and the chart, by design, does not: the
// chart's own namespace is Helm's to create (helm install --create-namespace), not a
// template's.
var onlyInKustomize = map[string]string{
	"Namespace//kvhandoff-system": "the release namespace: helm install -n kvhandoff-system --create-namespace makes it",
}

func run(t *testing.T, name string, args ...string) string {
	t.Helper()
	out, err := exec.Command(name, args...).CombinedOutput()
	if err != nil {
		t.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, out)
	}
	return string(out)
}

// toolPath runs a hack/ script that builds a tool (once) and returns the path it prints
// on stdout; what it says on stderr (a first build's progress) is only shown on failure.
func toolPath(t *testing.T, script string) string {
	t.Helper()
	var stderr strings.Builder
	cmd := exec.Command(script)
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("%s: %v\n%s", script, err, stderr.String())
	}
	return strings.TrimSpace(string(out))
}

func objects(t *testing.T, docs string) map[string]map[string]any {
	t.Helper()
	out := map[string]map[string]any{}
	for _, doc := range strings.Split(docs, "\n---") {
		var o map[string]any
		if err := yaml.Unmarshal([]byte(doc), &o); err != nil {
			t.Fatalf("%v in\n%s", err, doc)
		}
		if len(o) == 0 {
			continue
		}
		meta, _ := o["metadata"].(map[string]any)
		ns, _ := meta["namespace"].(string)
		out[fmt.Sprintf("%s/%s/%s", o["kind"], ns, meta["name"])] = o
	}
	return out
}

// `helm template` with the default values renders what config/default, config/agent and
// config/device-plugin render (the CRDs included: the chart's crds/ are copies make
// manifests keeps current), except onlyInKustomize.
func TestTheChartRendersWhatKustomizeRenders(t *testing.T) {
	for _, c := range []struct {
		name string
		set  []string
		dirs []string
	}{
		{"defaults", nil, []string{"default", "agent", "device-plugin"}},
		// The DRA driver in the device plugin's place.
		{"dra", []string{"--set", "dra.enabled=true", "--set", "devicePlugin.enabled=false"}, []string{"default", "agent", "dra"}},
	} {
		t.Run(c.name, func(t *testing.T) { chartRendersKustomize(t, c.set, c.dirs) })
	}
}

func chartRendersKustomize(t *testing.T, set, dirs []string) {
	root := envtest.RepoRoot()
	helm := toolPath(t, filepath.Join(root, "hack", "helm.sh"))
	bins, err := envtest.Binaries("kubectl")
	if err != nil {
		t.Fatal(err)
	}
	chart := filepath.Join(root, "charts", "kvhandoff")
	run(t, helm, append([]string{"lint", "--strict", chart}, set...)...)
	fromChart := objects(t, run(t, helm, append([]string{"template", "kvhandoff", chart, "--namespace", "kvhandoff-system", "--include-crds"}, set...)...))
	fromKustomize := map[string]map[string]any{}
	for _, dir := range dirs {
		for k, o := range objects(t, run(t, filepath.Join(bins, "kubectl"), "kustomize", filepath.Join(root, "config", dir))) {
			fromKustomize[k] = o
		}
	}
	var keys []string
	for k := range fromKustomize {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		c, ok := fromChart[k]
		switch {
		case onlyInKustomize[k] != "":
			if ok {
				t.Errorf("%s: the chart renders it, and onlyInKustomize says it should not (%s)", k, onlyInKustomize[k])
			}
		case !ok:
			t.Errorf("%s: config/ renders it, the chart does not", k)
		case !reflect.DeepEqual(c, fromKustomize[k]):
			a, _ := yaml.Marshal(fromKustomize[k])
			b, _ := yaml.Marshal(c)
			t.Errorf("%s differs:\n--- config/\n%s\n--- chart\n%s", k, a, b)
		}
		delete(fromChart, k)
	}
	for k := range fromChart {
		t.Errorf("%s: the chart renders it, config/ does not", k)
	}
}

// The values a user sets reach the objects: images and tag, the provider (whose EFA
// mounts go with it), the socket group, the agent's health window, secure metrics and a
// created token.
func TestTheChartsValuesReachTheObjects(t *testing.T) {
	root := envtest.RepoRoot()
	helm := toolPath(t, filepath.Join(root, "hack", "helm.sh"))
	out := run(t, helm, "template", "kvhandoff", filepath.Join(root, "charts", "kvhandoff"), "--namespace", "kvhandoff-system",
		"--set", "image.registry=registry.example/kvh", "--set", "image.tag=v9", "--set", "image.pullPolicy=Never",
		"--set", "agent.provider=tcp;ofi_rxm", "--set", "agent.socketGID=4242", "--set", "agent.metricsSecure=false",
		"--set", "agent.healthWindow=15s", "--set", "agent.token.create=true", "--set", "devicePlugin.bundles=true")
	for _, want := range []string{
		"image: registry.example/kvh/manager:v9", "image: registry.example/kvh/transfer-agent:v9", "image: registry.example/kvh/device-plugin:v9",
		"--router-image=registry.example/kvh/router:v9", "--connector-image=registry.example/kvh/vllm-connector:v9",
		"imagePullPolicy: Never", "--provider=tcp;ofi_rxm", "--socket-gid=4242", "--health-window=15s", "scheme: HTTP}", `"--bundles"`, "kind: Secret",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("helm template with values lacks %q", want)
		}
	}
	for _, unwanted := range []string{"--metrics-secure\n", "/dev/infiniband", "/opt/amazon/efa"} {
		if strings.Contains(out, unwanted) {
			t.Errorf("helm template with provider tcp and insecure metrics still has %q", unwanted)
		}
	}
}

// With monitoring.prometheusRule.enabled the chart installs its alert rules, exactly the
// groups of files/alerts.yaml (which test/alerts runs through promtool), with the labels
// the values give; without it, none.
func TestTheChartInstallsItsAlertRulesWhenAsked(t *testing.T) {
	root := envtest.RepoRoot()
	helm := toolPath(t, filepath.Join(root, "hack", "helm.sh"))
	chart := filepath.Join(root, "charts", "kvhandoff")
	if out := run(t, helm, "template", "kvhandoff", chart, "--namespace", "kvhandoff-system"); strings.Contains(out, "kind: PrometheusRule") {
		t.Error("a PrometheusRule without monitoring.prometheusRule.enabled")
	}
	out := run(t, helm, "template", "kvhandoff", chart, "--namespace", "kvhandoff-system",
		"--set", "monitoring.prometheusRule.enabled=true", "--set", "monitoring.prometheusRule.labels.release=prom")
	rule := objects(t, out)["PrometheusRule/kvhandoff-system/kvhandoff"]
	if rule == nil {
		t.Fatal("no PrometheusRule kvhandoff in kvhandoff-system")
	}
	b, err := os.ReadFile(filepath.Join(chart, "files", "alerts.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var file map[string]any
	if err := yaml.Unmarshal(b, &file); err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(rule["spec"], file) {
		t.Errorf("the PrometheusRule's spec differs from files/alerts.yaml:\n%v\n%v", rule["spec"], file)
	}
	if labels := rule["metadata"].(map[string]any)["labels"].(map[string]any); labels["release"] != "prom" {
		t.Errorf("labels %v lack the value's release=prom", labels)
	}
}

// With monitoring.podMonitors.enabled the chart installs a PodMonitor for the manager
// (honoring the pools' namespace label), the agents (in the node namespace) and the
// routers of every namespace, scraping secure endpoints over HTTPS with the token
// Secret; with monitoring.dashboard.enabled, the dashboard as a Grafana sidecar
// ConfigMap, byte for byte files/dashboard.json. Without them, none of it.
func TestTheChartInstallsMonitorsAndTheDashboardWhenAsked(t *testing.T) {
	root := envtest.RepoRoot()
	helm := toolPath(t, filepath.Join(root, "hack", "helm.sh"))
	chart := filepath.Join(root, "charts", "kvhandoff")
	if out := run(t, helm, "template", "kvhandoff", chart, "--namespace", "kvhandoff-system"); strings.Contains(out, "kind: PodMonitor") ||
		strings.Contains(out, "kvhandoff-dashboard") {
		t.Error("monitors or a dashboard without being asked")
	}
	out := run(t, helm, "template", "kvhandoff", chart, "--namespace", "kvhandoff-system", "--set", "monitoring.podMonitors.enabled=true",
		"--set", "monitoring.dashboard.enabled=true", "--set", "monitoring.podMonitors.labels.release=prom")
	objs := objects(t, out)
	endpoint := func(key string) map[string]any {
		o := objs[key]
		if o == nil {
			t.Fatalf("no %s", key)
		}
		if o["metadata"].(map[string]any)["labels"].(map[string]any)["release"] != "prom" {
			t.Errorf("%s lacks the value's label release=prom", key)
		}
		return o["spec"].(map[string]any)["podMetricsEndpoints"].([]any)[0].(map[string]any)
	}
	manager := endpoint("PodMonitor/kvhandoff-system/kvhandoff-manager")
	if manager["honorLabels"] != true || manager["scheme"] != "https" || manager["port"] != "metrics" {
		t.Errorf("manager endpoint %v", manager)
	}
	agent := endpoint("PodMonitor/kvhandoff-node/kvhandoff-transfer-agent")
	if agent["scheme"] != "https" || agent["authorization"].(map[string]any)["credentials"].(map[string]any)["name"] != "kvhandoff-metrics-token" {
		t.Errorf("agent endpoint %v", agent)
	}
	routers := endpoint("PodMonitor/kvhandoff-system/kvhandoff-routers")
	if routers["port"] != "admin" || objs["PodMonitor/kvhandoff-system/kvhandoff-routers"]["spec"].(map[string]any)["namespaceSelector"].(map[string]any)["any"] != true {
		t.Errorf("routers endpoint %v", routers)
	}
	cm := objs["ConfigMap/kvhandoff-system/kvhandoff-dashboard"]
	if cm == nil {
		t.Fatal("no dashboard ConfigMap")
	}
	file, err := os.ReadFile(filepath.Join(chart, "files", "dashboard.json"))
	if err != nil {
		t.Fatal(err)
	}
	if got := cm["data"].(map[string]any)["kvhandoff.json"]; got != strings.TrimSuffix(string(file), "\n") {
		t.Error("the dashboard ConfigMap differs from files/dashboard.json")
	}
	if cm["metadata"].(map[string]any)["labels"].(map[string]any)["grafana_dashboard"] != "1" {
		t.Error("the dashboard ConfigMap lacks grafana_dashboard=1")
	}
}
