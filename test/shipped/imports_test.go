// Package shipped checks what kvhandoff's shipped binaries link: the programs under
// cmd/, each an image's entry point, and nothing under cmd/ that is not shipped.
package shipped

import (
	"os/exec"
	"path"
	"strings"
	"testing"
)

const module = "github.com/kvhandoff/kvhandoff"

// testDouble says why a package has no place in a shipped binary, or "".
func testDouble(pkg string) string {
	rel, ours := strings.CutPrefix(pkg, module+"/")
	switch {
	case pkg == "testing":
		return "Go's testing package"
	case !ours:
		return ""
	case strings.HasPrefix(rel, "test/"):
		return "a test double or test harness (test/)"
	case strings.HasPrefix(rel, "bench/"):
		return "a benchmark (bench/)"
	case strings.HasPrefix(rel, "hack/"):
		return "a development program (hack/)"
	case strings.HasSuffix(path.Base(rel), "test") || strings.HasSuffix(path.Base(rel), "fake"):
		return "a substitute for tests (a package named *test or *fake)"
	}
	return ""
}

// Every program under cmd/ is shipped (it is some image's binary), and none links a test
// double, a benchmark, a development program or Go's testing package.
func TestShippedBinariesLinkNoTestDoubles(t *testing.T) {
	out := goList(t, "-f", "{{if eq .Name \"main\"}}{{.ImportPath}}{{end}}", module+"/cmd/...")
	mains := strings.Fields(out)
	if len(mains) < 5 {
		t.Fatalf("go list ./cmd/... found %d programs (%v): want the manager, router, transfer agent, device plugin and connector installer", len(mains), mains)
	}
	for _, m := range mains {
		for _, dep := range strings.Fields(goList(t, "-deps", m)) {
			if why := testDouble(dep); why != "" {
				t.Errorf("%s links %s: %s", m, dep, why)
			}
		}
	}
}

// The rule itself tells test doubles from product packages.
func TestTheRuleNamesTestDoubles(t *testing.T) {
	for pkg, double := range map[string]bool{
		module + "/test/simengine":                        true,
		module + "/bench/handoff":                         true,
		module + "/hack/images":                           true,
		module + "/internal/deviceplugin/sysfs/sysfstest": true,
		"testing":                                true,
		module + "/internal/deviceplugin/sysfs":  false,
		module + "/internal/transferagent/agent": false,
		"k8s.io/client-go/testing":               false, // client-go's own, linked through its clientset
	} {
		if got := testDouble(pkg) != ""; got != double {
			t.Errorf("testDouble(%s) = %v, want %v", pkg, got, double)
		}
	}
}

func goList(t *testing.T, args ...string) string {
	t.Helper()
	out, err := exec.Command("go", append([]string{"list"}, args...)...).Output()
	if err != nil {
		t.Fatalf("go list %v: %v", args, err)
	}
	return string(out)
}

// Each program of the request path links what its role needs and no more: an endpoint
// picker's flaw in parsing ZeroMQ, or the sidecar's in Envoy's API, is not the router's.
func TestEachRequestPathProgramLinksOnlyItsRole(t *testing.T) {
	for _, c := range []struct {
		program string
		not     []string
	}{
		{"router", []string{"github.com/go-zeromq/zmq4", "github.com/vmihailenco/msgpack", "github.com/envoyproxy/go-control-plane", "google.golang.org/grpc",
			module + "/internal/autoscale"}},
		{"endpoint-picker", []string{"github.com/go-zeromq/zmq4", "github.com/vmihailenco/msgpack"}},
		// The sidecar speaks ZeroMQ with its own bounded reader, not a library's.
		{"kv-events", []string{"github.com/envoyproxy/go-control-plane", "google.golang.org/grpc", "sigs.k8s.io/controller-runtime", "k8s.io/client-go",
			"github.com/go-zeromq/zmq4"}},
	} {
		for _, dep := range strings.Fields(goList(t, "-deps", module+"/cmd/"+c.program)) {
			for _, n := range c.not {
				if dep == n || strings.HasPrefix(dep, n+"/") {
					t.Errorf("cmd/%s links %s", c.program, dep)
				}
			}
		}
	}
}
