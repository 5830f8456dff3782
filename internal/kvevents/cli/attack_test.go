package cli

import (
	"bytes"
	"encoding/binary"
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

// sidecarProc runs the kv-events binary with the token 7f…7f until the test ends, its
// ZeroMQ listener on a loopback host of the test's own, and returns its address and
// that listener's (host:port).
func sidecarProc(t *testing.T, flags ...string) (addr, zmq string) {
	t.Helper()
	dir := t.TempDir()
	bin, err := gobin.Build(dir, "kv-events")
	if err != nil {
		t.Fatal(err)
	}
	token := filepath.Join(dir, "token")
	_ = os.WriteFile(token, []byte(strings.Repeat("7f", 32)+"\n"), 0o600)
	zmq = loopback.New(t) + ":5557"
	addr = gobin.Start(t, bin, `"msg":"kv-events serving","listen":"([^"]+)"`, append([]string{"--served-model=m", "--engine=127.0.0.1:1",
		"--listen=127.0.0.1:0", "--kv-events-endpoint=tcp://" + zmq, "--token-file=" + token}, flags...)...)[1]
	return addr, zmq
}

// The kv-events sidecar, as built: only a follower bearing the pool's token gets the
// keys (anyone on the pod network reaches the port); a publisher's malformed messages
// are refused, counted, and leave it serving.
func TestTheKVEventsSidecarServesOnlyTheTokensHolder(t *testing.T) {
	addr, zmqAddr := sidecarProc(t)
	zmq := "tcp://" + zmqAddr
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
	_, err := io.ReadFull(resp.Body, first)
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
	addr, _ := sidecarProc(t, "--max-connections=64")
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

// hostilePublisher is a peer that greets the sidecar's ZeroMQ listener as a PUB socket
// does, then sends whatever the test writes.
func hostilePublisher(t *testing.T, addr string) net.Conn {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	g := make([]byte, 64)
	g[0], g[9], g[10], g[11] = 0xff, 0x7f, 3, 1
	copy(g[12:], "NULL")
	props := append([]byte{11}, "Socket-Type"...)
	props = append(binary.BigEndian.AppendUint32(props, 3), "PUB"...)
	ready := append([]byte{5}, "READY"...)
	ready = append(ready, props...)
	if _, err := c.Write(append(append(g, 0x04, byte(len(ready))), ready...)); err != nil {
		t.Fatal(err)
	}
	// Its greeting, READY and subscription.
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.ReadFull(c, make([]byte, 64)); err != nil {
		t.Fatalf("the sidecar's greeting: %v", err)
	}
	_ = c.SetReadDeadline(time.Time{})
	return c
}

// The attacks on the sidecar's ZeroMQ listener (the pod's own loopback): 73 bytes
// announcing a 2^62-byte frame panicked it; frames marked "more" grew its memory without
// end (448 MB sent, 484 MB RSS); 6 MB of nested arrays overflowed its stack; one silent
// connection locked the real publisher out. Each is refused now, the sidecar serves on,
// and the real publisher's events arrive.
func TestHostilePublishersNeitherCrashNorLockOutTheSidecar(t *testing.T) {
	addr, zmqAddr := sidecarProc(t)
	refused := func() float64 { return gobin.Metric(t, addr, `kvhandoff_kv_events_resets_total{reason="refused"}`) }
	waitRefused := func(what string, n float64) {
		t.Helper()
		for deadline := time.Now().Add(30 * time.Second); refused() < n; {
			if time.Now().After(deadline) {
				t.Fatalf("%s: not refused", what)
			}
			time.Sleep(10 * time.Millisecond) // polling the sidecar's count
		}
	}

	// One that connects and never greets: the real publisher still gets in (below).
	silent, err := net.Dial("tcp", zmqAddr)
	if err != nil {
		t.Fatal(err)
	}
	defer silent.Close()

	// A frame announcing 2^62 bytes.
	c := hostilePublisher(t, zmqAddr)
	_, _ = c.Write(append([]byte{0x02}, binary.BigEndian.AppendUint64(nil, 1<<62)...))
	waitRefused("a frame of 2^62 bytes", 1)

	// Frames marked "more", 64 MB in all.
	c = hostilePublisher(t, zmqAddr)
	chunk := append(append([]byte{0x03}, binary.BigEndian.AppendUint64(nil, 4<<20)...), make([]byte, 4<<20)...)
	for range 16 {
		if _, err := c.Write(chunk); err != nil {
			break // refused: the sidecar closed the connection
		}
	}
	waitRefused("a message of 16 frames of 4 MB", 2)

	// 6 MB of nested arrays, as a well-framed vLLM message.
	c = hostilePublisher(t, zmqAddr)
	nested := append(bytes.Repeat([]byte{0x91}, 6<<20), 0xc0)
	msg := append([]byte{0x01, 2}, "kv"...)
	msg = append(append(msg, 0x01, 8), make([]byte, 8)...)
	msg = append(append(msg, 0x02), binary.BigEndian.AppendUint64(nil, uint64(len(nested)))...)
	if _, err := c.Write(append(msg, nested...)); err != nil {
		t.Fatal(err)
	}
	waitRefused("6 MB of nested arrays", 3)
	rss := gobin.Metric(t, addr, "process_resident_memory_bytes")
	t.Logf("RSS %.0f MB after the attacks", rss/1e6)
	if rss > 128<<20 {
		t.Errorf("the sidecar's RSS is %.0f MB after the attacks", rss/1e6)
	}

	// The real publisher, a ZeroMQ library's PUB socket, is heard.
	pub := zmq4.NewPub(t.Context(), zmq4.WithDialerRetry(50*time.Millisecond), zmq4.WithDialerMaxRetries(100))
	defer pub.Close()
	if err := pub.Dial("tcp://" + zmqAddr); err != nil {
		t.Fatal(err)
	}
	payload, err := os.ReadFile("../testdata/batch-array.msgpack")
	if err != nil {
		t.Fatal(err)
	}
	for i := uint64(0); gobin.Metric(t, addr, `kvhandoff_kv_events_total{kind="BlockStored"}`) == 0; i++ {
		if i > 2000 {
			t.Fatal("the real publisher's events did not arrive")
		}
		if err := pub.Send(zmq4.NewMsgFrom([]byte("kv"), binary.BigEndian.AppendUint64(nil, i), payload)); err != nil {
			t.Fatal(err)
		}
		time.Sleep(5 * time.Millisecond) // a publisher's pace; the loop ends on what the sidecar counted
	}
}
