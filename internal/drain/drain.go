// Package drain is an engine pod's preStop hook: it returns once the engine has nothing
// in flight, so that a scale-down (or any deletion) loses no request and no handoff.
//
// By the time the hook runs the pod is terminating, and the routers and endpoint pickers,
// which follow pods, have stopped choosing it (they skip pods with a deletion timestamp).
// What it may still hold: requests it is serving (vLLM's num_requests_running and
// num_requests_waiting, the latter including decode requests waiting for their KV), and
// finished prefill requests whose blocks are held for a transfer still to come or under
// way (the held file, which kvhandoff's vLLM connector keeps: a decimal count). The hook
// waits until all are zero and have stayed zero for Quiet (a leg routed just before the
// routers saw the deletion is still on its way), then returns; the kubelet then sends the
// engine SIGTERM. The pod's terminationGracePeriodSeconds bounds the wait.
package drain

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"os"
	"strconv"
	"strings"
	"time"
)

// Config is what the hook watches.
type Config struct {
	// MetricsURL is the engine's Prometheus endpoint (vLLM's /metrics).
	MetricsURL string
	// HeldFile is the connector's count of requests whose blocks are held for a
	// transfer; "" or a missing file counts none.
	HeldFile string
	// Quiet is how long the engine must stay idle; Every how often it is checked.
	Quiet, Every time.Duration
	// Log gets a line whenever what the engine holds changes.
	Log io.Writer
}

// Wait returns once the engine has been idle for Quiet, or ctx's error.
func Wait(ctx context.Context, c Config) error {
	client := &http.Client{Timeout: 2 * time.Second}
	var idleSince time.Time
	last := ""
	for {
		now := time.Now()
		busy, what := holds(ctx, client, c)
		if what != last {
			fmt.Fprintf(c.Log, "drain: %s\n", what)
			last = what
		}
		switch {
		case busy:
			idleSince = time.Time{}
		case idleSince.IsZero():
			idleSince = now
		case now.Sub(idleSince) >= c.Quiet:
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(c.Every):
		}
	}
}

// holds reports whether the engine holds anything, and what.
func holds(ctx context.Context, client *http.Client, c Config) (bool, string) {
	held, err := readHeld(c.HeldFile)
	if err != nil {
		// A count that cannot be read is not a count of zero.
		return true, err.Error()
	}
	running, waiting, err := requests(ctx, client, c.MetricsURL)
	var bad badCount
	if errors.As(err, &bad) {
		// The engine answers, and what it says is not a count: not a count of zero.
		return true, err.Error()
	}
	if err != nil {
		// The engine no longer answers: it serves nothing, and there is nothing to wait for.
		return held > 0, fmt.Sprintf("engine metrics unavailable (%v); %d request(s) hold blocks for a transfer", err, held)
	}
	return running+waiting+held > 0, fmt.Sprintf("%d running, %d waiting, %d holding blocks for a transfer", running, waiting, held)
}

// requests sums vLLM's num_requests_running and num_requests_waiting over every series.
func requests(ctx context.Context, client *http.Client, url string) (running, waiting int64, err error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return 0, 0, err
	}
	resp, err := client.Do(req)
	if err != nil {
		return 0, 0, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return 0, 0, fmt.Errorf("%s: %s", url, resp.Status)
	}
	sc := bufio.NewScanner(io.LimitReader(resp.Body, 64<<20))
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		var sum *int64
		switch {
		case strings.HasPrefix(line, "vllm:num_requests_running"):
			sum = &running
		case strings.HasPrefix(line, "vllm:num_requests_waiting"):
			sum = &waiting
		default:
			continue
		}
		f := strings.Fields(line)
		v, err := strconv.ParseFloat(f[len(f)-1], 64)
		if err != nil || math.IsNaN(v) || math.IsInf(v, 0) || v < 0 {
			return 0, 0, badCount{fmt.Errorf("%s: %q: not a count of requests", url, line)}
		}
		*sum += int64(v)
	}
	return running, waiting, sc.Err()
}

// badCount is a request count the engine gave that is not a count (NaN, infinite,
// negative, not a number).
type badCount struct{ error }

func readHeld(path string) (int64, error) {
	if path == "" {
		return 0, nil
	}
	b, err := os.ReadFile(path)
	if os.IsNotExist(err) {
		return 0, nil
	}
	if err != nil {
		return 0, fmt.Errorf("reading %s: %w", path, err)
	}
	n, err := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
	if err != nil || n < 0 {
		return 0, fmt.Errorf("%s holds %q, not a count", path, b)
	}
	return n, nil
}

// WriteHeld replaces the held file with n, atomically (a reader never sees half of it).
func WriteHeld(path string, n int64) error {
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, []byte(strconv.FormatInt(n, 10)+"\n"), 0o644); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}
