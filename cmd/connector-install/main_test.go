package main

import (
	"bufio"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvhandoff/kvhandoff/internal/drain"
	"github.com/kvhandoff/kvhandoff/test/simengine/vllmserver"
)

// The init container installs the connector and its own binary as the drain hook, and
// the hook, as the kubelet runs it, returns only once the engine has answered what it
// was serving and no request holds blocks for a transfer.
func TestTheInstalledDrainHookWaitsForTheEngineToEmpty(t *testing.T) {
	bin := filepath.Join(t.TempDir(), "install")
	if out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	dir := t.TempDir()
	if out, err := exec.Command(bin, dir).CombinedOutput(); err != nil {
		t.Fatalf("install: %v\n%s", err, out)
	}
	hook := filepath.Join(dir, drainName)
	if fi, err := os.Stat(hook); err != nil || fi.Mode().Perm() != 0o555 {
		t.Fatalf("the drain hook was not installed executable: %v %v", fi, err)
	}
	if _, err := os.Stat(filepath.Join(dir, "kvhandoff_vllm", "connector.py")); err != nil {
		t.Fatalf("the connector was not installed: %v", err)
	}

	engine := httptest.NewServer(vllmserver.New(vllmserver.Config{EngineID: "e", Model: "m", TPOT: 20 * time.Millisecond}))
	defer engine.Close()
	held := filepath.Join(t.TempDir(), "held")
	if err := drain.WriteHeld(held, 1); err != nil {
		t.Fatal(err)
	}

	// A request streams for about a second while a transfer holds blocks.
	answered := make(chan struct{})
	go func() {
		defer close(answered)
		resp, err := http.Post(engine.URL+"/v1/completions", "application/json",
			strings.NewReader(`{"model":"m","prompt":"a b","max_tokens":50,"stream":true}`))
		if err == nil {
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
		}
	}()
	cmd := exec.Command(hook, "--metrics="+engine.URL+"/metrics", "--held="+held, "--quiet=300ms", "--every=20ms")
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	lines := make(chan string)
	go func() {
		defer close(lines)
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			lines <- sc.Text()
		}
	}()
	var log []string
	// expect reads the hook's lines up to the one that contains want.
	expect := func(want string) {
		t.Helper()
		for line := range lines {
			log = append(log, line)
			if strings.Contains(line, want) {
				return
			}
		}
		t.Fatalf("the hook ended without saying %q:\n%s", want, strings.Join(log, "\n"))
	}
	expect("1 running, 0 waiting, 1 holding blocks")
	<-answered
	// The engine is empty; the transfer still holds blocks: the hook waits.
	expect("0 running, 0 waiting, 1 holding blocks")
	if err := drain.WriteHeld(held, 0); err != nil {
		t.Fatal(err)
	}
	expect("0 running, 0 waiting, 0 holding blocks")
	expect("the engine is idle")
	if err := cmd.Wait(); err != nil {
		t.Fatalf("the hook: %v", err)
	}
}
