package balance

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/kvhandoff/kvhandoff/internal/router/discovery"
)

// vLLM's gauges, by their names in its Prometheus exposition. Older releases called the
// KV usage gpu_cache_usage_perc; both are read.
var gauges = map[string]func(*Load, float64){
	"vllm:num_requests_running": func(l *Load, v float64) { l.Running += v },
	"vllm:num_requests_waiting": func(l *Load, v float64) { l.Waiting += v },
	"vllm:kv_cache_usage_perc":  func(l *Load, v float64) { l.KVUsage = max(l.KVUsage, v) },
	"vllm:gpu_cache_usage_perc": func(l *Load, v float64) { l.KVUsage = max(l.KVUsage, v) },
}

// ParseLoad reads an engine's load from its Prometheus text exposition. Series of one
// name (one per model or engine index) are summed; usage takes the highest.
func ParseLoad(r io.Reader) (Load, error) {
	var l Load
	found := false
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if line == "" || line[0] == '#' {
			continue
		}
		name := line
		if i := strings.IndexAny(line, "{ "); i >= 0 {
			name = line[:i]
		}
		if name == "vllm:cache_config_info" {
			l.Blocks = max(l.Blocks, labelInt(line, "num_gpu_blocks"))
			continue
		}
		set, ok := gauges[name]
		if !ok {
			continue
		}
		// The value follows the labels: the first field after the closing brace.
		rest := line[len(name):]
		if strings.HasPrefix(rest, "{") {
			end := strings.LastIndexByte(rest, '}')
			if end < 0 {
				continue
			}
			rest = rest[end+1:]
		}
		fields := strings.Fields(rest)
		if len(fields) == 0 {
			continue
		}
		v, err := strconv.ParseFloat(fields[0], 64)
		if err != nil {
			continue
		}
		set(&l, v)
		found = true
	}
	if err := sc.Err(); err != nil {
		return Load{}, err
	}
	if !found {
		return Load{}, fmt.Errorf("no vLLM load gauges (vllm:num_requests_running, …) in the exposition")
	}
	return l, nil
}

// labelInt reads label name's value of a series line as a number; 0 when absent.
func labelInt(line, name string) int {
	_, rest, ok := strings.Cut(line, name+`="`)
	if !ok {
		return 0
	}
	v, _, _ := strings.Cut(rest, `"`)
	n, _ := strconv.Atoi(v)
	return n
}

// Scrape reads one engine's load from base+"/metrics".
func Scrape(ctx context.Context, c *http.Client, base string) (Load, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, base+"/metrics", nil)
	if err != nil {
		return Load{}, err
	}
	resp, err := c.Do(req)
	if err != nil {
		return Load{}, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return Load{}, fmt.Errorf("%s/metrics: %s", base, resp.Status)
	}
	l, err := ParseLoad(io.LimitReader(resp.Body, 8<<20))
	l.At = time.Now()
	return l, err
}

// Follow reads every engine's load of the current set once per interval, all engines at
// once, until ctx ends. An engine that does not answer keeps its last load until it goes
// stale.
func (b *Balancer) Follow(ctx context.Context, c *http.Client, interval time.Duration, current func() *discovery.Set) {
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		set := current()
		if set == nil {
			continue
		}
		sctx, cancel := context.WithTimeout(ctx, interval)
		var wg sync.WaitGroup
		for role, es := range map[Role][]discovery.Engine{Prefill: set.Prefill, Decode: set.Decode} {
			for _, e := range es {
				wg.Go(func() {
					if l, err := Scrape(sctx, c, e.URL); err == nil {
						b.SetLoad(role, e.EngineID, l)
						if b.OnLoad != nil {
							b.OnLoad(role, e.EngineID, l)
						}
					}
				})
			}
		}
		wg.Wait()
		cancel()
	}
}
