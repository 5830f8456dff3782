package kvevents

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/kvhandoff/kvhandoff/internal/keystream"
	"github.com/kvhandoff/kvhandoff/test/loopback"
)

func eventually(t *testing.T, what string, ok func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !ok() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond) // polling a condition, not synchronising on time
	}
}

type sidecar struct {
	srv  *Server
	reg  *prometheus.Registry
	http *httptest.Server
}

// token writes a token file.
func token(t *testing.T, value string) string {
	path := filepath.Join(t.TempDir(), "token")
	if err := os.WriteFile(path, []byte(value), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

var poolToken = strings.Repeat("ab", 32)

func newSidecar(t *testing.T) *sidecar {
	reg := prometheus.NewRegistry()
	s := NewServer(NewKeys("m", 1000), reg)
	hs := httptest.NewServer(Authorized(token(t, poolToken), s))
	t.Cleanup(hs.Close)
	return &sidecar{srv: s, reg: reg, http: hs}
}

func counter(t *testing.T, reg *prometheus.Registry, name, label string) prometheus.Collector {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			if m.GetLabel()[0].GetValue() == label {
				return prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "v"}, func() float64 { return m.GetCounter().GetValue() })
			}
		}
	}
	t.Fatalf("no %s{%s}", name, label)
	return nil
}

// A follower refuses a stream that is not the protocol, and a sidecar cuts off one that
// does not read, without holding up the engine's events.
func TestStreamsRefuseWhatIsNotTheProtocol(t *testing.T) {
	for name, frame := range map[string][]byte{
		"an unknown op":  {'X', 0, 0, 0, 0},
		"a huge frame":   binary.BigEndian.AppendUint32([]byte{keystream.OpAdd}, keystream.MaxFrameKeys+1),
		"a short frame":  {keystream.OpAdd, 0, 0, 0, 2, 1, 2, 3},
		"a short header": {keystream.OpAdd, 0},
	} {
		if _, _, err := keystream.ReadFrame(bufio.NewReader(bytes.NewReader(frame)), nil); err == nil {
			t.Errorf("%s: read", name)
		}
	}
	s := newSidecar(t)
	// A follower that never reads: its connection's buffers fill, then its queue.
	c, err := net.Dial("tcp", s.http.Listener.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := io.WriteString(c, "GET "+keystream.StreamPath+" HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "+poolToken+"\r\n\r\n"); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the follower registered", func() bool { return testutil.ToFloat64(gauge(t, s.reg, "kvhandoff_kv_events_followers")) == 1 })
	big := stored(hashes(1, 200), "", seq(0, 800))
	for i := 0; testutil.ToFloat64(gauge(t, s.reg, "kvhandoff_kv_events_followers")) == 1; i++ {
		if i > 100000 {
			t.Fatal("a follower that never reads was never cut off")
		}
		s.srv.Apply(Batch{Seq: uint64(i), Events: []Event{big, {Kind: KindRemoved, Hashes: big.Hashes, Medium: "GPU"}}})
	}
}

func gauge(t *testing.T, reg *prometheus.Registry, name string) prometheus.Collector {
	t.Helper()
	return prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "v"}, func() float64 {
		mfs, _ := reg.Gather()
		for _, mf := range mfs {
			if mf.GetName() == name {
				return mf.GetMetric()[0].GetGauge().GetValue()
			}
		}
		return -1
	})
}

// vLLM's publisher connects to the sidecar's listener on loopback over ZeroMQ; what it
// publishes reaches the hub, and a message that is not vLLM's resets what is held rather
// than stopping the sidecar.
func TestSubscribeRelaysAPublisher(t *testing.T) {
	endpoint := "tcp://" + loopback.New(t) + ":5557"
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	reg := prometheus.NewRegistry()
	srv := NewServer(NewKeys("m", 1000), reg)
	done := make(chan error, 1)
	sub, err := Listen(endpoint, "kv", srv, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	go func() { done <- sub.Relay(ctx) }()

	pub := zmq4.NewPub(ctx, zmq4.WithDialerRetry(50*time.Millisecond), zmq4.WithDialerMaxRetries(100))
	defer pub.Close()
	if err := pub.Dial(endpoint); err != nil {
		t.Fatal(err)
	}
	payload, err := os.ReadFile("testdata/batch-array.msgpack")
	if err != nil {
		t.Fatal(err)
	}
	held := func() float64 { return testutil.ToFloat64(gauge(t, reg, "kvhandoff_kv_events_blocks")) }
	stores := func() float64 { return testutil.ToFloat64(counter(t, reg, "kvhandoff_kv_events_total", KindStored)) }
	// A SUB learns its subscription a moment after connecting: publish until one arrives.
	for i := uint64(0); stores() == 0; i++ {
		if i > 2000 {
			t.Fatal("nothing published reached the hub")
		}
		if err := pub.Send(zmq4.NewMsgFrom([]byte("kv"), binary.BigEndian.AppendUint64(nil, i), payload)); err != nil {
			t.Fatal(err)
		}
		time.Sleep(5 * time.Millisecond) // a publisher's pace, not synchronisation: the loop ends on what arrived
	}
	if err := pub.Send(zmq4.NewMsgFrom([]byte("kv"), binary.BigEndian.AppendUint64(nil, 1<<40), []byte("not msgpack"))); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the refused message counted", func() bool {
		return testutil.ToFloat64(counter(t, reg, "kvhandoff_kv_events_resets_total", "refused")) == 1
	})
	if held() != 0 {
		t.Errorf("%v blocks held after a refused message", held())
	}
	cancel()
	if err := <-done; err != nil {
		t.Errorf("Subscribe: %v", err)
	}
}

// An engine whose API refuses connections has stopped: its keys go, and followers are
// told it emptied.
func TestWatchEngineForgetsAStoppedEngine(t *testing.T) {
	s := newSidecar(t)
	s.srv.Apply(Batch{Seq: 0, Events: []Event{stored(hashes(1, 2), "", seq(0, 8))}})
	engine := httptest.NewServer(http.NotFoundHandler())
	addr := engine.Listener.Addr().String()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go WatchEngine(ctx, addr, 10*time.Millisecond, s.srv)
	stopped := func() float64 {
		return testutil.ToFloat64(counter(t, s.reg, "kvhandoff_kv_events_resets_total", "stopped"))
	}
	engine.Close()
	eventually(t, "the stopped engine forgotten", func() bool { return stopped() == 1 })
	if s.srv.keys.Len() != 0 {
		t.Errorf("%d blocks held", s.srv.keys.Len())
	}
}
