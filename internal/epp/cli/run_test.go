package cli

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestFlagsThatCannotPickAreRefusedByName(t *testing.T) {
	file := filepath.Join(t.TempDir(), "endpoints.json")
	_ = os.WriteFile(file, []byte(`{"mode":"Pull","prefill":[{"url":"http://127.0.0.1:1","engineID":"p"}],"decode":[{"url":"http://127.0.0.1:2","engineID":"d"}]}`), 0o644)
	for _, c := range []struct {
		args []string
		want string
	}{
		{nil, "--decode-pool and --namespace in a cluster, or --endpoints FILE"},
		{[]string{"--leg-runner-port", "0", "--endpoints", file}, `"0": must be a port number, 1 to 65535`},
		{[]string{"--leg-runner-port", "8200,x", "--endpoints", file}, `"x": must be a port number`},
		{[]string{"--mode", "epp", "--endpoints", file}, "flag provided but not defined: -mode"},
	} {
		var stderr bytes.Buffer
		if code := Run(c.args, &stderr, nil); code == 0 || !strings.Contains(stderr.String(), c.want) {
			t.Errorf("%v: exit %d, %s; want an error containing %q", c.args, code, stderr.String(), c.want)
		}
	}
}

// The picker's limits are its own, stated in --help: not the router's (its 1024 in
// flight once overwrote the picker's 4096).
func TestThePickersLimitsAreItsOwn(t *testing.T) {
	var stderr bytes.Buffer
	Run([]string{"--help"}, &stderr, nil)
	for _, want := range []string{"past it 429 at once (default 4096)", "all streams together; past it 429 (default 67108864)", "(default 30s)", "(default 1h0m0s)", "(default 256)"} {
		if !strings.Contains(stderr.String(), want) {
			t.Errorf("--help lacks %q:\n%s", want, stderr.String())
		}
	}
}
