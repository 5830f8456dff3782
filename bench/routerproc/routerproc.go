// Package routerproc runs the router binary for the benchmarks and the demo: started on an
// endpoints file, ready once /readyz answers 200, stopped with SIGTERM (it drains).
package routerproc

import (
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"syscall"
	"time"

	"github.com/kvhandoff/kvhandoff/test/loopback"
)

// Proc is a running router.
type Proc struct {
	// URL is where clients reach it.
	URL string
	// Log is the path of its log (JSON, one line per request).
	Log string

	cmd    *exec.Cmd
	host   *loopback.Host
	exited chan struct{}
	log    *os.File
}

// Start runs bin on endpoints, logging to logPath, with args added, and waits until it is
// ready to route.
func Start(bin, endpoints, logPath string, args ...string) (*Proc, error) {
	host, err := loopback.Claim()
	if err != nil {
		return nil, err
	}
	p := &Proc{URL: "http://" + host.Addr(8000), Log: logPath, exited: make(chan struct{}), host: host}
	if p.log, err = os.Create(logPath); err != nil {
		host.Release()
		return nil, err
	}
	// On a host of its own, with the ports it has in a pod (args may name others).
	p.cmd = exec.Command(bin, append([]string{"--endpoints", endpoints, "--listen", host.Addr(8000), "--admin-listen", host.Addr(8001)}, args...)...)
	p.cmd.Stderr = p.log
	if err := p.cmd.Start(); err != nil {
		p.log.Close()
		host.Release()
		return nil, err
	}
	go func() { _ = p.cmd.Wait(); close(p.exited) }()
	deadline := time.Now().Add(30 * time.Second)
	for time.Now().Before(deadline) {
		select {
		case <-p.exited:
			p.log.Close()
			host.Release()
			return nil, fmt.Errorf("the router exited at start; its log is %s", logPath)
		default:
		}
		if resp, err := http.Get(p.URL + "/readyz"); err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return p, nil
			}
		}
		time.Sleep(20 * time.Millisecond) // polling a starting process: nothing to wait on
	}
	p.Stop()
	return nil, fmt.Errorf("the router did not become ready in 30 s; its log is %s", logPath)
}

// Stop ends the router: SIGTERM, and SIGKILL if it has not drained within 10 s.
func (p *Proc) Stop() {
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.exited:
	case <-time.After(10 * time.Second):
		_ = p.cmd.Process.Kill()
		<-p.exited
	}
	p.log.Close()
	p.host.Release()
}
