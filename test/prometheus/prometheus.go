// Package prometheus runs a real Prometheus server (Debian's, 2.42, which
// hack/prometheus.sh unpacks once) against the test's own processes: it scrapes their /metrics
// and evaluates kvhandoff's alert rules, so a test sees what an operator's Prometheus
// would page on.
package prometheus

import (
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvhandoff/kvhandoff/test/envtest"
	"github.com/kvhandoff/kvhandoff/test/loopback"
)

// Target is one scraped endpoint and the target labels a PodMonitor would give it.
type Target struct {
	Address string
	Labels  map[string]string
	// HonorLabels keeps the scraped series' own namespace and pod labels (the manager's
	// pool metrics carry the pool's namespace).
	HonorLabels bool
}

// Server is a running Prometheus.
type Server struct {
	URL string
}

// Rules returns the chart's alert rules with their windows and "for" durations shortened
// to window and hold, so that a test sees an alert fire and resolve in seconds; the
// expressions and thresholds are the chart's own.
func Rules(t testing.TB, window, hold string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(envtest.RepoRoot(), "charts", "kvhandoff", "files", "alerts.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	s := regexp.MustCompile(`\[\d+[smh]\]`).ReplaceAllString(string(b), "["+window+"]")
	return regexp.MustCompile(`(?m)^(\s+for:) .*$`).ReplaceAllString(s, "${1} "+hold)
}

// Start runs Prometheus with rules (a rule file's text), scraping targets every 500 ms
// and evaluating every 500 ms, until the test ends.
func Start(t testing.TB, rules string, targets ...Target) *Server {
	t.Helper()
	tool := exec.Command(filepath.Join(envtest.RepoRoot(), "hack", "prometheus.sh"))
	tool.Stderr = os.Stderr
	bin, err := tool.Output()
	if err != nil {
		t.Fatalf("unpacking Prometheus (hack/prometheus.sh): %v", err)
	}
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "rules.yaml"), []byte(rules), 0o644); err != nil {
		t.Fatal(err)
	}
	var cfg strings.Builder
	cfg.WriteString("global: {scrape_interval: 500ms, scrape_timeout: 400ms, evaluation_interval: 500ms}\nrule_files: [rules.yaml]\nscrape_configs:\n")
	for i, tg := range targets {
		labels, _ := json.Marshal(tg.Labels)
		fmt.Fprintf(&cfg, "- job_name: t%d\n  honor_labels: %v\n  static_configs: [{targets: [%q], labels: %s}]\n", i, tg.HonorLabels, tg.Address, labels)
	}
	if err := os.WriteFile(filepath.Join(dir, "prometheus.yml"), []byte(cfg.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	addr := net.JoinHostPort(loopback.New(t), "9090")
	cmd := exec.Command(strings.TrimSpace(string(bin)), "--config.file="+filepath.Join(dir, "prometheus.yml"),
		"--storage.tsdb.path="+filepath.Join(dir, "data"), "--web.listen-address="+addr, "--log.level=warn")
	var log syncBuffer
	cmd.Stdout, cmd.Stderr = &log, &log
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan struct{})
	go func() { _ = cmd.Wait(); close(exited) }()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		<-exited
		if t.Failed() {
			t.Logf("prometheus log:\n%s", log.String())
		}
	})
	s := &Server{URL: "http://" + addr}
	deadline := time.Now().Add(60 * time.Second)
	for {
		if resp, err := http.Get(s.URL + "/-/ready"); err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return s
			}
		}
		select {
		case <-exited:
			t.Fatalf("prometheus exited:\n%s", log.String())
		case <-time.After(100 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			t.Fatalf("prometheus not ready within 60s:\n%s", log.String())
		}
	}
}

// Alert is one active alert.
type Alert struct {
	Labels map[string]string `json:"labels"`
	State  string            `json:"state"`
}

// Firing returns the alerts firing now whose labels include match.
func (s *Server) Firing(name string, match map[string]string) ([]Alert, error) {
	resp, err := http.Get(s.URL + "/api/v1/alerts")
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	var body struct {
		Data struct {
			Alerts []Alert `json:"alerts"`
		} `json:"data"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&body); err != nil {
		return nil, err
	}
	var out []Alert
	for _, a := range body.Data.Alerts {
		if a.State != "firing" || a.Labels["alertname"] != name {
			continue
		}
		ok := true
		for k, v := range match {
			ok = ok && a.Labels[k] == v
		}
		if ok {
			out = append(out, a)
		}
	}
	return out, nil
}

// Query evaluates expr now and returns its series' label sets; an expression Prometheus
// refuses is an error naming why.
func (s *Server) Query(expr string) ([]map[string]string, error) {
	resp, err := http.Get(s.URL + "/api/v1/query?query=" + url.QueryEscape(expr))
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	var body struct {
		Status string `json:"status"`
		Error  string `json:"error"`
		Data   struct {
			Result []struct {
				Metric map[string]string `json:"metric"`
			} `json:"result"`
		} `json:"data"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&body); err != nil {
		return nil, err
	}
	if body.Status != "success" {
		return nil, fmt.Errorf("%s: %s", expr, body.Error)
	}
	out := make([]map[string]string, len(body.Data.Result))
	for i, r := range body.Data.Result {
		out[i] = r.Metric
	}
	return out, nil
}

// DashboardQueries are the expressions of the chart's Grafana dashboard, with its
// variables set to every namespace and a rate interval of window.
func DashboardQueries(t testing.TB, window string) map[string]string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(envtest.RepoRoot(), "charts", "kvhandoff", "files", "dashboard.json"))
	if err != nil {
		t.Fatal(err)
	}
	var d struct {
		Panels []struct {
			Title   string `json:"title"`
			Targets []struct {
				Expr         string `json:"expr"`
				LegendFormat string `json:"legendFormat"`
			} `json:"targets"`
		} `json:"panels"`
	}
	if err := json.Unmarshal(b, &d); err != nil {
		t.Fatal(err)
	}
	out := map[string]string{}
	for _, p := range d.Panels {
		for _, tg := range p.Targets {
			expr := strings.NewReplacer(`"$namespace"`, `".*"`, "$__rate_interval", window).Replace(tg.Expr)
			out[p.Title+": "+tg.LegendFormat] = expr
		}
	}
	return out
}

type syncBuffer struct {
	mu sync.Mutex
	b  strings.Builder
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}
