package compat

import (
	"bufio"
	"os"
	"strings"
	"testing"
)

// The manager accepts for executor Agent exactly the releases the connector's contract
// test checks (vllm-connector/tested-vllm.txt): the first, the newest minor, and nothing
// around them.
func TestAgentRangeIsTheConnectorsTestedReleases(t *testing.T) {
	f, err := os.Open("../../vllm-connector/tested-vllm.txt")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var tested []Version
	for s := bufio.NewScanner(f); s.Scan(); {
		line := strings.TrimSpace(s.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		v, ok := ImageVersion("vllm/vllm-openai:v" + line)
		if !ok {
			t.Fatalf("tested-vllm.txt: %q is not a version", line)
		}
		tested = append(tested, v)
	}
	if len(tested) == 0 {
		t.Fatal("tested-vllm.txt lists no release")
	}
	for _, v := range tested {
		if !AgentSupports(v) {
			t.Errorf("the connector is tested with vLLM %s, which the manager refuses", v)
		}
	}
	first, last := tested[0], tested[len(tested)-1]
	if first != MinAgentVersion {
		t.Errorf("MinAgentVersion = %s, the first tested release is %s", MinAgentVersion, first)
	}
	if last.Major != MaxAgentMinor.Major || last.Minor != MaxAgentMinor.Minor {
		t.Errorf("MaxAgentMinor = %s, the newest tested release is %s", MaxAgentMinor, last)
	}
	for _, v := range []Version{{first.Major, first.Minor - 1, 9}, {last.Major, last.Minor + 1, 0}, {last.Major + 1, 0, 0}} {
		if AgentSupports(v) {
			t.Errorf("the manager accepts vLLM %s, which the connector is not tested with", v)
		}
	}
}
