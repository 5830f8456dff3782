package agentproc

import (
	"fmt"
	"os"
	"testing"
)

// TestFlags are the timeouts the two-process test suites start agents with: short enough
// that a lost message fails a test in seconds.
var TestFlags = []string{"--lease", "5s", "--registration-timeout", "10s", "--blocks-ttl", "5s"}

// RunTests is a TestMain for suites that run agents: it sets *bin to a prebuilt agent
// ($KVHANDOFF_AGENT_BIN, e.g. one built with -race) or builds one, then runs the tests.
func RunTests(m *testing.M, bin *string) int {
	if *bin = os.Getenv("KVHANDOFF_AGENT_BIN"); *bin != "" {
		return m.Run()
	}
	dir, err := os.MkdirTemp("", "kvhandoff-agent-test")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer os.RemoveAll(dir)
	if *bin, err = Build(dir); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	return m.Run()
}

// StartTest starts an agent with TestFlags (then flags) for the test t: it is stopped
// when the test ends, and its log printed if the test failed.
func StartTest(t testing.TB, bin, name, dir, provider string, flags ...string) *Proc {
	t.Helper()
	p, err := Start(bin, name, dir, provider, append(append([]string{}, TestFlags...), flags...)...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		p.Stop()
		if t.Failed() {
			t.Logf("agent %s log:\n%s", name, p.Log())
		}
	})
	return p
}
