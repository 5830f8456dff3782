package cli

import (
	"io"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
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
