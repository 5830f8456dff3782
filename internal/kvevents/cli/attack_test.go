package cli

import (
	"errors"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"

	"github.com/kvhandoff/kvhandoff/test/gobin"
	"github.com/kvhandoff/kvhandoff/test/loopback"
)

// The kv-events sidecar, as built: only a follower bearing the pool's token gets the
// keys (anyone on the pod network reaches the port); a publisher's malformed messages
// are refused, counted, and leave it serving.
func TestTheKVEventsSidecarServesOnlyTheTokensHolder(t *testing.T) {
	dir := t.TempDir()
	bin, err := gobin.Build(dir, "kv-events")
	if err != nil {
		t.Fatal(err)
	}
	token := filepath.Join(dir, "token")
	_ = os.WriteFile(token, []byte(strings.Repeat("7f", 32)+"\n"), 0o600)
	zmq := "tcp://" + loopback.New(t) + ":5557"
	addr := gobin.Start(t, bin, `"msg":"kv-events serving","listen":"([^"]+)"`, "--served-model=m", "--engine=127.0.0.1:1",
		"--listen=127.0.0.1:0", "--kv-events-endpoint="+zmq, "--token-file="+token)[1]
	get := func(auth string) *http.Response {
		req, _ := http.NewRequest(http.MethodGet, "http://"+addr+"/v1/kv-keys", nil)
		if auth != "" {
			req.Header.Set("Authorization", auth)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		return resp
	}
	for _, auth := range []string{"", "Bearer ", "Bearer " + strings.Repeat("7f", 31), "Bearer " + strings.Repeat("7f", 32) + "x", strings.Repeat("7f", 32)} {
		resp := get(auth)
		resp.Body.Close()
		if resp.StatusCode != http.StatusUnauthorized {
			t.Errorf("Authorization %q: %s, want 401", auth, resp.Status)
		}
	}
	resp := get("Bearer " + strings.Repeat("7f", 32))
	first := make([]byte, 5)
	_, err = io.ReadFull(resp.Body, first)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || err != nil || first[0] != 'S' {
		t.Fatalf("the token's holder: %s, %q, %v", resp.Status, first, err)
	}

	// A publisher that is not vLLM: what it sends is refused, the sidecar serves on.
	pub := zmq4.NewPub(t.Context(), zmq4.WithDialerRetry(50*time.Millisecond), zmq4.WithDialerMaxRetries(100))
	defer pub.Close()
	if err := pub.Dial(zmq); err != nil {
		t.Fatal(err)
	}
	refused := func() string {
		resp, err := http.Get("http://" + addr + "/metrics")
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return regexp.MustCompile(`kvhandoff_kv_events_resets_total\{reason="refused"\} (\d+)`).FindStringSubmatch(string(b))[1]
	}
	for i := 0; refused() == "0"; i++ {
		if i > 2000 {
			t.Fatal("no malformed message was refused")
		}
		for _, m := range []zmq4.Msg{zmq4.NewMsgFrom([]byte("kv")), zmq4.NewMsgFrom([]byte("kv"), []byte{1, 2}, []byte{0xc1}),
			zmq4.NewMsgFrom([]byte("kv"), make([]byte, 8), []byte{0x92, 0x01, 0xdd, 0xff, 0xff, 0xff, 0xff})} {
			if err := pub.Send(m); err != nil {
				t.Fatal(err)
			}
		}
		time.Sleep(5 * time.Millisecond) // a publisher's pace; the loop ends on what the sidecar counted
	}
	if resp := get("Bearer " + strings.Repeat("7f", 32)); resp.StatusCode != http.StatusOK {
		t.Errorf("after malformed messages: %s", resp.Status)
	} else {
		resp.Body.Close()
	}
}

// The attack: 3,000 keep-alive connections that sent nothing stayed open on the sidecar
// for good (+56 MB; about 25k would take it past its limit). It takes --max-connections
// at once (the rest wait in the kernel's queue, costing it nothing) and closes one that
// has not sent its headers within serve.HeaderTimeout (10 s). A new connection still
// waits behind the flood (here 3,000 / 64 × 10 s): that only routers and pickers reach
// the port is the NetworkPolicy's part.
func TestSilentConnectionsAreBoundedInNumberAndTime(t *testing.T) {
	dir := t.TempDir()
	bin, err := gobin.Build(dir, "kv-events")
	if err != nil {
		t.Fatal(err)
	}
	token := filepath.Join(dir, "token")
	_ = os.WriteFile(token, []byte(strings.Repeat("7f", 32)+"\n"), 0o600)
	addr := gobin.Start(t, bin, `"msg":"kv-events serving","listen":"([^"]+)"`, "--served-model=m", "--engine=127.0.0.1:1", "--listen=127.0.0.1:0",
		"--kv-events-endpoint=tcp://"+loopback.New(t)+":5557", "--token-file="+token, "--max-connections=64")[1]
	// An operator's connection, made before the flood and kept alive, reads the sidecar's
	// memory through it.
	operator := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 1}, Timeout: 10 * time.Second}
	rss := func() float64 {
		resp, err := operator.Get("http://" + addr + "/metrics")
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		m := regexp.MustCompile(`(?m)^process_resident_memory_bytes (\S+)$`).FindStringSubmatch(string(body))
		if m == nil {
			t.Fatal("no process_resident_memory_bytes")
		}
		v, _ := strconv.ParseFloat(m[1], 64)
		return v
	}
	before := rss()
	var silent []net.Conn
	for range 3000 {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		silent = append(silent, c)
	}
	defer func() {
		for _, c := range silent {
			c.Close()
		}
	}()
	after := rss()
	t.Logf("RSS %.0f MB before, %.0f MB with 3,000 silent connections", before/1e6, after/1e6)
	if after-before > 24<<20 {
		t.Errorf("3,000 silent connections cost the sidecar %.0f MB", (after-before)/1e6)
	}
	start := time.Now()
	_ = silent[0].SetReadDeadline(time.Now().Add(30 * time.Second))
	if n, err := silent[0].Read(make([]byte, 1)); n != 0 || !errors.Is(err, io.EOF) {
		t.Fatalf("a silent connection: read %d, %v; want it closed by the sidecar", n, err)
	}
	t.Logf("the first silent connection closed after %s", time.Since(start).Round(100*time.Millisecond))
}
