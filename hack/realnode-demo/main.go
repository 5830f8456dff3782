// Command realnode-demo is make demo's real node: kvhandoff installed from its Helm chart
// on a real kubelet with containerd (test/realnode), images built here, a CPU pair of
// pools in push and one in pull whose engines are the simulated-engine image, one chat
// request through each DecodePool's router Service, the agent pod's account of the KV it
// moved, one request through Envoy and kvhandoff's endpoint picker to the push pool, and
// the pull pair's autoscaling: one scale-up under load and one scale-down after it, with
// the pool's events. With DEMO_KEEP=1 the node stays up until Ctrl-C. It needs root, as
// the kubelet does, and runs in a network and mount namespace of its own.
package main

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
	"github.com/kvhandoff/kvhandoff/test/envtest"
	"github.com/kvhandoff/kvhandoff/test/realnode"
)

// images are what the demo runs.
var images = []string{"pause", "manager", "router", "transfer-agent", "device-plugin", "vllm-connector", "envoy", realnode.SimEngines.Image}

func main() { os.Exit(realnode.Run(demo, images...)) }

func demo() int {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx); err != nil {
		fmt.Fprintln(os.Stderr, "realnode-demo:", err)
		return 1
	}
	return 0
}

func run(ctx context.Context) error {
	step("building the images without Docker (hack/images) and starting a real node: kubelet, containerd, runc, CNI bridge, kube-proxy")
	archives, err := realnode.BuildImages(filepath.Join(envtest.RepoRoot(), "bin", "images"), images...)
	if err != nil {
		return err
	}
	dir, err := os.MkdirTemp("", "kvhandoff-realnode-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	n, err := realnode.Start(ctx, dir, archives...)
	if err != nil {
		return err
	}
	defer func() {
		if err := n.Stop(); err != nil {
			fmt.Fprintln(os.Stderr, "realnode-demo: stopping the node:", err)
		}
	}()
	kubectl := func(args ...string) error {
		cmd := exec.CommandContext(ctx, n.Kubectl(), append([]string{"--kubeconfig", n.Kubeconfig}, args...)...)
		out, err := cmd.CombinedOutput()
		fmt.Print(indent(string(out)))
		return err
	}
	if err := kubectl("get", "nodes", "-o", "wide"); err != nil {
		return err
	}

	step("the Gateway API Inference Extension's InferencePool CRD (from its Go module, v1.2.0)")
	if err := n.InstallGatewayCRDs(); err != nil {
		return err
	}

	step("helm install kvhandoff charts/kvhandoff   (the manager's Deployment; the agent and device plugin DaemonSets)")
	if err := n.InstallChart(append(n.ChartValues(), realnode.PlainMetrics, realnode.AutoscaleInterval)...); err != nil {
		return fmt.Errorf("%w\n%s", err, n.LogTail(20))
	}

	step("a CPU pair of pools per mode (accelerator.type: CPU, executor: Agent, provider: tcp), engines = the simulated-engine image; " +
		"the push DecodePool also behind a gateway (gateway.inferencePool: true), the pull DecodePool autoscaled (spec.autoscaling), its " +
		"engines' speed following their load")
	modes := []kvv1.TransferMode{kvv1.TransferPush, kvv1.TransferPull}
	for _, m := range modes {
		engines, tune := realnode.SimEngines, func(d *kvv1.DecodePool) {
			d.Spec.Gateway.InferencePool, d.Spec.Gateway.EndpointPickerReplicas = true, ptr.To[int32](1)
		}
		if m == kvv1.TransferPull {
			engines, tune = realnode.LoadFollowingEngines, realnode.Autoscaled
		}
		if err := n.CreatePair(ctx, engines, m, tune); err != nil {
			return err
		}
	}
	for _, m := range modes {
		if err := n.WaitPair(ctx, strings.ToLower(string(m)), 4*time.Minute); err != nil {
			return fmt.Errorf("%w\n%s", err, n.LogTail(20))
		}
	}
	if err := kubectl("get", "kvtp,pfp,dcp", "-o", "wide"); err != nil {
		return err
	}

	step("the pods on the real node: kubectl get pods -A -o wide")
	if err := kubectl("get", "pods", "-A", "-o", "wide"); err != nil {
		return err
	}

	step("one chat request through each DecodePool's router Service; the agent pod's account of the KV it moved")
	for _, m := range modes {
		mode := strings.ToLower(string(m))
		series := fmt.Sprintf("kvhandoff_agent_transferred_bytes_total{mode=%q}", mode)
		before, err := n.AgentMetric(series)
		if err != nil {
			return err
		}
		url, _ := n.RouterURL(mode, "/v1/chat/completions")
		prompt := "What moves the KV cache in " + mode + " mode?"
		status, body, answer, err := n.Chat(mode, realnode.SimEngines.Model, prompt)
		if err != nil || status != 200 {
			return fmt.Errorf("%s: POST %s: %d %s %v", mode, url, status, body, err)
		}
		after, err := n.AgentMetric(series)
		if err != nil {
			return err
		}
		fmt.Printf("  %s: POST %s %q\n    200: %q\n    agent pod: %s %.0f -> %.0f bytes\n", mode, url, prompt, answer, series, before, after)
		if after <= before {
			return fmt.Errorf("%s: the agent pod moved no KV bytes", mode)
		}
	}
	if err := kubectl("logs", "-n", "kvhandoff-node", "daemonset/kvhandoff-transfer-agent", "--tail", "6"); err != nil {
		return err
	}

	step("the push pool behind Envoy: its InferencePool, its endpoint picker, and one chat request through Envoy → picker → the decode pod's leg runner")
	if err := kubectl("get", "inferencepools,deployments,services", "-l", "app.kubernetes.io/instance=push-decode"); err != nil {
		return err
	}
	gw, err := n.StartGateway(ctx, "push", realnode.SimEngines.Model, 2*time.Minute)
	if err != nil {
		return fmt.Errorf("%w\n%s", err, n.LogTail(20))
	}
	url, _ := n.ServiceURL(gw, "/v1/chat/completions")
	prompt := "Which engine prefilled this request?"
	status, body, answer, err := n.ChatVia(gw, realnode.SimEngines.Model, prompt)
	if err != nil || status != 200 {
		return fmt.Errorf("through envoy: POST %s: %d %s %v", url, status, body, err)
	}
	fmt.Printf("  POST %s %q\n    200: %q\n", url, prompt, answer)
	if err := kubectl("logs", "push-decode-0", "-c", "leg-runner", "--tail", "2"); err != nil {
		return err
	}

	if err := autoscale(ctx, n, kubectl); err != nil {
		return err
	}

	if os.Getenv("DEMO_KEEP") == "1" {
		step(fmt.Sprintf("real node kept up (Ctrl-C stops it); its network is this program's own:\n"+
			"  nsenter --net=/proc/%d/ns/net %s --kubeconfig %s get pods -A -o wide", os.Getpid(), n.Kubectl(), n.Kubeconfig))
		<-ctx.Done()
	}
	step("stopping the real node")
	return nil
}

// autoscale loads the pull pair until its prefill grows, then stops and waits until both
// pools are back at one engine each, and shows the DecodePool's events.
func autoscale(ctx context.Context, n *realnode.Node, kubectl func(...string) error) error {
	step("autoscaling: the pull DecodePool's spec.autoscaling (TTFT p90 ≤ 1.5 s, ITL p90 ≤ 30 ms, 1–3 engines a role, a budget of 4)")
	if err := kubectl("get", "dcp", "pull-decode", "-o", "jsonpath={.spec.autoscaling}{\"\\n\"}"); err != nil {
		return err
	}
	step("6 prompts a second of 200 words through the pull router: prefill must grow")
	load, err := n.StartLoad("pull", realnode.PrefillHeavy)
	if err != nil {
		return err
	}
	defer load.Stop()
	sizes := func() (prefill, decode int32) {
		d := &kvv1.DecodePool{}
		if err := n.Client.Get(ctx, client.ObjectKey{Namespace: "default", Name: "pull-decode"}, d); err != nil || d.Status.Autoscaling == nil {
			return 0, 0
		}
		return d.Status.Autoscaling.PrefillReplicas, d.Status.Autoscaling.DecodeReplicas
	}
	if err := realnode.WaitFor(ctx, "the pull pair's prefill to grow", 3*time.Minute, func() bool {
		p, _ := sizes()
		_, ready := n.Pods("pull-prefill", kvv1.RolePrefill)
		return p >= 2 && ready == int(p)
	}); err != nil {
		return err
	}
	if err := kubectl("get", "pfp,dcp", "-o", "wide"); err != nil {
		return err
	}
	step("the load stops: both roles go back to one engine after the stabilization window, each engine draining before it exits")
	load.Stop()
	if err := realnode.WaitFor(ctx, "the pull pair back at one engine a role", 3*time.Minute, func() bool {
		p, d := sizes()
		pAll, _ := n.Pods("pull-prefill", kvv1.RolePrefill)
		dAll, _ := n.Pods("pull-decode", kvv1.RoleDecode)
		return p == 1 && d == 1 && pAll == 1 && dAll == 1
	}); err != nil {
		return err
	}
	failed := 0
	for _, r := range load.Results() {
		if r.Failed() {
			failed++
		}
	}
	fmt.Printf("  %d requests, %d failed\n", len(load.Results()), failed)
	if failed > 0 {
		return fmt.Errorf("%d requests failed while the pull pair scaled", failed)
	}
	for _, reason := range []string{kvv1.ReasonScaledUp, kvv1.ReasonScaledDown} {
		if err := kubectl("get", "events", "--field-selector", "involvedObject.name=pull-decode,reason="+reason, "--sort-by", ".metadata.creationTimestamp",
			"-o", "custom-columns=REASON:.reason,MESSAGE:.message"); err != nil {
			return err
		}
	}
	return nil
}

func step(s string) { fmt.Printf("\n\033[1m== %s\033[0m\n", s) }

func indent(s string) string {
	s = strings.TrimRight(s, "\n")
	if s == "" {
		return ""
	}
	return "  " + strings.ReplaceAll(s, "\n", "\n  ") + "\n"
}
