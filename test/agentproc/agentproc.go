// Package agentproc runs transfer agents as separate processes on loopback, for the
// two-process tests, the handoff benchmark and the demo: real agents, real libfabric,
// nothing in between.
package agentproc

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/kvhandoff/kvhandoff/test/gobin"
)

// Build builds cmd/transfer-agent into dir and returns the binary's path.
func Build(dir string) (string, error) {
	return gobin.Build(dir, "transfer-agent")
}

// Token is the peer token the agents started here share.
const Token = "kvhandoff-loopback-token-0123456789"

// Proc is a running agent.
type Proc struct {
	Name   string
	Dir    string
	Socket string
	Peer   string // host:port of its peer listener
	HTTP   string // host:port of /metrics, /healthz, /readyz

	cmd     *exec.Cmd
	exited  chan struct{}
	exitErr error
	mu      sync.Mutex
	log     bytes.Buffer
	grew    chan struct{} // closed, and replaced, whenever a line is added to log
}

// Start starts the agent binary bin with its sockets and token in dir
// (reusing a dir restarts "the same node's" agent) and waits until it serves. flags
// come last, so they override the defaults here.
func Start(bin, name, dir, provider string, flags ...string) (*Proc, error) {
	return start(bin, name, dir, provider, Options{}, flags...)
}

// Options are how agents are run beyond their flags.
type Options struct {
	// Env is added to the agents' environment (such as LD_LIBRARY_PATH, to run them on
	// another libfabric).
	Env []string
	// CPUs, when set, is the CPU list (taskset's syntax, such as "0-7") the agents run
	// on, so that what else runs on the machine does not compete with them.
	CPUs string
	// Flags are more agent flags (such as --rails 2).
	Flags []string
}

func start(bin, name, dir, provider string, o Options, flags ...string) (*Proc, error) {
	token := filepath.Join(dir, "token")
	if err := os.WriteFile(token, []byte(Token), 0o600); err != nil {
		return nil, err
	}
	p := &Proc{Name: name, Dir: dir, Socket: filepath.Join(dir, "agent.sock"), exited: make(chan struct{}), grew: make(chan struct{})}
	args := append([]string{
		"--provider", provider, "--socket", p.Socket,
		"--peer-listen", "127.0.0.1:0", "--http", "127.0.0.1:0", "--peer-token-file", token,
	}, append(o.Flags, flags...)...)
	if o.CPUs != "" {
		args = append([]string{"-c", o.CPUs, bin}, args...)
		bin = "taskset"
	}
	p.cmd = exec.Command(bin, args...)
	if o.Env != nil {
		p.cmd.Env = append(os.Environ(), o.Env...)
	}
	p.cmd.Dir = dir // libinfinipath drops *.btr files in the working directory on crashes
	// Not StderrPipe: its Wait closes the pipe on exit, and the last lines (such as
	// "stopped") could be lost. Through an io.Pipe, Wait returns once the scanner took
	// everything, and exited closes once it has kept it.
	stderr, w := io.Pipe()
	p.cmd.Stderr = w
	if err := p.cmd.Start(); err != nil {
		return nil, err
	}
	ready, scanned := make(chan struct{}), make(chan struct{})
	go func() { p.scan(stderr, ready); close(scanned) }()
	go func() {
		err := p.cmd.Wait()
		w.Close()
		<-scanned
		p.exitErr = err
		close(p.exited)
	}()
	select {
	case <-ready:
		return p, nil
	case <-p.exited:
		return nil, fmt.Errorf("agent %s exited before serving: %v\n%s", name, p.exitErr, p.Log())
	case <-time.After(30 * time.Second):
		// A starved test process can wake to both the line and the timer, and select
		// picks either: a deadline is final only once the line is checked again.
		select {
		case <-ready:
			return p, nil
		default:
		}
		p.Kill()
		return nil, fmt.Errorf("agent %s did not serve within 30s\n%s", name, p.Log())
	}
}

// scan keeps the agent's log and picks the addresses it reports.
func (p *Proc) scan(r io.Reader, ready chan struct{}) {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Bytes()
		var rec map[string]any
		_ = json.Unmarshal(line, &rec)
		p.mu.Lock()
		p.log.Write(line)
		p.log.WriteByte('\n')
		close(p.grew)
		p.grew = make(chan struct{})
		switch rec["msg"] {
		case "http":
			p.HTTP, _ = rec["addr"].(string)
		case "serving":
			p.Peer, _ = rec["peers"].(string)
			close(ready)
		}
		p.mu.Unlock()
	}
	_, _ = io.Copy(io.Discard, r) // past an over-long line: never block the agent's writes
}

// Log is everything the agent logged so far.
func (p *Proc) Log() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.log.String()
}

// WaitLog waits until the agent has logged want, at most within. The agent logs
// before it answers, but its log reaches the test through a pipe, so a line may be a
// moment behind the answer it precedes.
func (p *Proc) WaitLog(want string, within time.Duration) bool {
	deadline := time.After(within)
	for {
		p.mu.Lock()
		has, grew := strings.Contains(p.log.String(), want), p.grew
		p.mu.Unlock()
		if has {
			return true
		}
		select {
		case <-grew:
		case <-p.exited:
			return strings.Contains(p.Log(), want)
		case <-deadline:
			return strings.Contains(p.Log(), want) // as in start: the line may have come with the deadline
		}
	}
}

// Stop sends SIGTERM, waits, and returns how the process exited.
func (p *Proc) Stop() error {
	select {
	case <-p.exited:
		return p.exitErr
	default:
	}
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.exited:
	case <-time.After(30 * time.Second):
		p.Kill()
	}
	return p.exitErr
}

// Pid is the agent process's id.
func (p *Proc) Pid() int { return p.cmd.Process.Pid }

// Kill ends the agent without letting it clean up, as a crash would.
func (p *Proc) Kill() {
	_ = p.cmd.Process.Kill()
	<-p.exited
}

// Get fetches a path from the agent's HTTP endpoint.
func (p *Proc) Get(path string) (int, string, error) {
	resp, err := http.Get("http://" + p.HTTP + path)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b), err
}

// Metrics reads /metrics once: every sample's value by its series (name and labels).
func (p *Proc) Metrics() (map[string]float64, error) {
	_, body, err := p.Get("/metrics")
	if err != nil {
		return nil, err
	}
	out := map[string]float64{}
	for _, line := range strings.Split(body, "\n") {
		series, value, ok := strings.Cut(line, " ")
		if !ok || strings.HasPrefix(line, "#") {
			continue
		}
		var v float64
		if _, err := fmt.Sscan(value, &v); err == nil {
			out[series] = v
		}
	}
	return out, nil
}

// Metric reads one series' value from /metrics (0 when absent).
func (p *Proc) Metric(series string) (float64, error) {
	m, err := p.Metrics()
	return m[series], err
}

// StartPair starts the two agents of a prefill node and a decode node, each in its own
// folder under dir, as the benchmarks and demos run them. Stop both when done.
func StartPair(bin, dir, provider string) (prefill, decode *Proc, err error) {
	return StartPairWith(bin, dir, provider, Options{})
}

// StartPairWith is StartPair with options.
func StartPairWith(bin, dir, provider string, o Options) (prefill, decode *Proc, err error) {
	node := func(name string) (*Proc, error) {
		d := filepath.Join(dir, name)
		if err := os.MkdirAll(d, 0o755); err != nil {
			return nil, err
		}
		return start(bin, name, d, provider, o)
	}
	if prefill, err = node("prefill-node"); err != nil {
		return nil, nil, err
	}
	if decode, err = node("decode-node"); err != nil {
		prefill.Stop()
		return nil, nil, err
	}
	return prefill, decode, nil
}
