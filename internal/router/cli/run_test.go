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
	for _, c := range []struct {
		args []string
		want string
	}{
		{nil, "--decode-pool and --namespace in a cluster, or --endpoints FILE"},
		{[]string{"--decode-pool", "d"}, "--namespace is required with --decode-pool"},
		{[]string{"--decode-pool", "d", "--endpoints", bad}, "exclude each other"},
		{[]string{"--endpoints", bad}, "prefill[0]: host, sideChannelPort and tensorParallelSize must be set in Push mode"},
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
