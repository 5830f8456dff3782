package cli

import (
	"bytes"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

func TestFlagsThatCannotRouteAreRefusedByName(t *testing.T) {
	dir := t.TempDir()
	bad := filepath.Join(dir, "bad.json")
	_ = os.WriteFile(bad, []byte(`{"mode":"Push","prefill":[{"url":"http://a:1","engineID":"p"}],"decode":[]}`), 0o644)
	short := filepath.Join(dir, "short-token")
	_ = os.WriteFile(short, []byte("0123456789abcdef\n"), 0o600)
	for _, c := range []struct {
		args []string
		want string
	}{
		{nil, "--decode-pool and --namespace in a cluster, or --endpoints FILE"},
		{[]string{"--decode-pool", "d"}, "--namespace is required with --decode-pool"},
		{[]string{"--decode-pool", "d", "--endpoints", bad}, "exclude each other"},
		{[]string{"--endpoints", bad}, "prefill[0]: host, sideChannelPort and tensorParallelSize must be set in Push mode"},
		{[]string{"--mode", "gateway", "--endpoints", bad}, `--mode "gateway": must be router, epp, leg-runner or kv-events`},
		{[]string{"--mode", "kv-events", "--local", "127.0.0.1:8000"}, "--served-model is required with --mode kv-events"},
		{[]string{"--mode", "kv-events", "--served-model", "m"}, "--local is required with --mode kv-events"},
		{[]string{"--mode", "kv-events", "--served-model", "m", "--local", "127.0.0.1:8000", "--max-blocks", "0"}, "--max-blocks is 0: must be positive"},
		{[]string{"--mode", "kv-events", "--served-model", "m", "--local", "127.0.0.1:8000"}, "--kv-events-token-file is required"},
		{[]string{"--mode", "kv-events", "--served-model", "m", "--local", "127.0.0.1:8000", "--kv-events-token-file", short}, "is 16 characters: at least 32"},
		{[]string{"--mode", "leg-runner", "--endpoints", bad}, "--local is the leg runner's decode engine: required with --mode leg-runner"},
		{[]string{"--local", "http://198.18.0.1:8000", "--endpoints", bad}, "required with --mode leg-runner, and only there"},
		{[]string{"--mode", "epp", "--leg-runner-port", "0", "--endpoints", bad}, "must be a port number"},
	} {
		var stderr bytes.Buffer
		if code := Run(c.args, &stderr, nil); code == 0 || !strings.Contains(stderr.String(), c.want) {
			t.Errorf("%v: exit %d, %s; want an error containing %q", c.args, code, stderr.String(), c.want)
		}
	}
}

func TestTheRouterServesFromAnEndpointsFileAndStopsOnASignal(t *testing.T) {
	file := filepath.Join(t.TempDir(), "endpoints.json")
	_ = os.WriteFile(file,
		[]byte(`{"mode":"Pull","prefill":[{"url":"http://127.0.0.1:1","engineID":"p"}],"decode":[{"url":"http://127.0.0.1:2","engineID":"d"}]}`), 0o644)
	ready := make(chan string, 1)
	exit := make(chan int, 1)
	var stderr bytes.Buffer
	go func() {
		exit <- Run([]string{"--endpoints", file, "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0", "--drain", "1s"}, &stderr, ready)
	}()
	var addr string
	select {
	case addr = <-ready:
	case code := <-exit:
		t.Fatalf("exited %d: %s", code, stderr.String())
	}
	deadline := time.Now().Add(5 * time.Second)
	for {
		resp, err := http.Get("http://" + addr + "/readyz")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				break
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("not ready: %v", err)
		}
		time.Sleep(10 * time.Millisecond) // polling a server that loads its file in the background
	}
	if err := syscall.Kill(os.Getpid(), syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	select {
	case code := <-exit:
		if code != 0 {
			t.Errorf("exit %d after SIGTERM: %s", code, stderr.String())
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the router did not stop on SIGTERM")
	}
}
