package cli

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvhandoff/kvhandoff/test/gobin"
)

// proc is a running router binary: its clients' and its operators' addresses.
type proc struct{ addr, admin string }

// routerProc runs the router binary with an endpoints file of engines that never answer,
// and returns its addresses; it is stopped when the test ends.
func routerProc(t *testing.T, flags ...string) proc {
	return routerProcTo(t, "http://127.0.0.1:2", flags...)
}

// routerProcTo is routerProc with the decode engine at decode.
func routerProcTo(t *testing.T, decode string, flags ...string) proc {
	t.Helper()
	dir := t.TempDir()
	bin, err := gobin.Build(dir, "router")
	if err != nil {
		t.Fatal(err)
	}
	file := filepath.Join(dir, "endpoints.json")
	_ = os.WriteFile(file,
		[]byte(`{"mode":"Pull","prefill":[{"url":"http://127.0.0.1:1","engineID":"p"}],"decode":[{"url":"`+decode+`","engineID":"d"}]}`), 0o644)
	m := gobin.Start(t, bin, `"msg":"router serving","listen":"([^"]+)","admin-listen":"([^"]+)"`,
		append([]string{"--endpoints", file, "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0", "--drain", "1s"}, flags...)...)
	return proc{addr: m[1], admin: m[2]}
}

// Clients that announce large bodies and stall hold neither memory nor the router: the
// body's buffer grows with what arrived, the body must arrive within --body-timeout
// (408), and past --max-in-flight requests are answered 429 at once. Before, 60 clients
// that announced 32 MiB took the router's heap to 2.0 GB, and nothing ever timed out.
func TestStalledBodiesAreBoundedInTimeMemoryAndNumber(t *testing.T) {
	r := routerProc(t, "--body-timeout", "3s", "--max-in-flight", "20")
	addr := r.addr
	heapBefore := gobin.Metric(t, r.admin, "go_memstats_heap_alloc_bytes")
	const clients = 30
	type answer struct {
		status int
		body   string
	}
	answers := make(chan answer, clients)
	var conns []net.Conn
	for range clients {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		conns = append(conns, c)
		fmt.Fprintf(c, "POST /v1/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n", 32<<20-1)
		c.Write([]byte(`{"prompt":"` + strings.Repeat("x", 1000)))
		go func() {
			c.SetReadDeadline(time.Now().Add(30 * time.Second))
			resp, err := http.ReadResponse(bufio.NewReader(c), nil)
			if err != nil {
				answers <- answer{status: 0, body: err.Error()}
				return
			}
			b, _ := io.ReadAll(resp.Body)
			answers <- answer{resp.StatusCode, string(b)}
		}()
	}
	defer func() {
		for _, c := range conns {
			c.Close()
		}
	}()
	// While they stall, the router holds what they sent, not what they announced.
	if grew := gobin.Metric(t, r.admin, "go_memstats_heap_alloc_bytes") - heapBefore; grew > 64<<20 {
		t.Errorf("the router's heap grew %.0f MB for %d stalled bodies of 1 KB each", grew/1e6, clients)
	}
	got := map[int]int{}
	for range clients {
		a := <-answers
		got[a.status]++
		if a.status == http.StatusTooManyRequests && !strings.Contains(a.body, "--max-in-flight") {
			t.Errorf("a 429 that does not name its limit: %s", a.body)
		}
	}
	if got[http.StatusTooManyRequests] != clients-20 || got[http.StatusRequestTimeout] != 20 {
		t.Errorf("answers by status %v, want %d × 429 and 20 × 408", got, clients-20)
	}
}

// A prompt of arrays nested thousands deep costs the router one pass over its bytes.
// Before, counting its tokens rescanned every level: 3.7 s of CPU for 1 MiB.
func TestADeeplyNestedPromptCostsOnePass(t *testing.T) {
	r := routerProc(t)
	addr := r.addr
	cpuBefore := gobin.Metric(t, r.admin, "process_cpu_seconds_total")
	const depth = 9990
	body := `{"prompt":` + strings.Repeat("[", depth) + `"` + strings.Repeat("x", 1<<20-2*depth) + `"` + strings.Repeat("]", depth) + `}`
	resp, err := http.Post("http://"+addr+"/v1/completions", "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode/100 != 5 { // the engines never answer
		t.Errorf("status %d, want the engines' failure", resp.StatusCode)
	}
	if spent := gobin.Metric(t, r.admin, "process_cpu_seconds_total") - cpuBefore; spent > 1 {
		t.Errorf("the router spent %.1f s of CPU on one nested prompt", spent)
	}
}

// The attack: the clients' port served /metrics (engine names, traffic) and the health
// report to anyone who could reach it, and relayed every header an engine set. Those are
// on the admin listener only now, and a client gets only the headers that describe the
// body.
func TestClientsSeeNeitherMetricsNorEngineHeaders(t *testing.T) {
	engine := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Server", "uvicorn")
		w.Header().Set("Set-Cookie", "engine-session=secret")
		w.Header().Set("X-Engine-Internal", "198.18.0.7")
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write([]byte(`{"object":"list","data":[]}`))
	}))
	defer engine.Close()
	r := routerProcTo(t, engine.URL)
	for _, path := range []string{"/metrics", "/health/transfer"} {
		if code := status(t, "http://"+r.addr+path); code != http.StatusNotFound {
			t.Errorf("GET %s on the clients' port: %d, want 404", path, code)
		}
		if code := status(t, "http://"+r.admin+path); code != http.StatusOK {
			t.Errorf("GET %s on the admin port: %d, want 200", path, code)
		}
	}
	resp, err := http.Get("http://" + r.addr + "/v1/models")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	for _, h := range []string{"Server", "Set-Cookie", "X-Engine-Internal"} {
		if v := resp.Header.Get(h); v != "" {
			t.Errorf("the engine's %s header reached the client: %q", h, v)
		}
	}
	if got := resp.Header.Get("Content-Type"); got != "application/json" {
		t.Errorf("Content-Type %q, want the engine's application/json", got)
	}
}

func status(t *testing.T, url string) int {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	return resp.StatusCode
}
