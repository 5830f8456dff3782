// Package alerts checks kvhandoff's alert rules (charts/kvhandoff/files/alerts.yaml) with
// Prometheus's own promtool (Debian's, which hack/promtool.sh unpacks once): the rules parse,
// each fires on series shaped like kvhandoff's metrics only past its threshold and its
// "for" (alerts_test.yaml), and every metric they and the dashboard name is one kvhandoff
// exports.
package alerts

import (
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/kvhandoff/kvhandoff/test/envtest"
)

func rules() string {
	return filepath.Join(envtest.RepoRoot(), "charts", "kvhandoff", "files", "alerts.yaml")
}

func TestTheAlertRulesParseAndFireAsDescribed(t *testing.T) {
	out, err := exec.Command(filepath.Join(envtest.RepoRoot(), "hack", "promtool.sh")).Output()
	if err != nil {
		t.Fatalf("hack/promtool.sh: %v", err)
	}
	promtool := strings.TrimSpace(string(out))
	for _, args := range [][]string{{"check", "rules", rules()}, {"test", "rules", "alerts_test.yaml"}} {
		if out, err := exec.Command(promtool, args...).CombinedOutput(); err != nil {
			t.Errorf("promtool %s: %v\n%s", strings.Join(args, " "), err, out)
		}
	}
}

// A rule on a metric nobody exports never fires, and a dashboard panel on one stays
// empty: each kvhandoff_* name in the rules and the dashboard must be registered by the
// code (a metric renamed alone fails here). The dashboard's queries run on a real
// Prometheus in test/agent's fault test.
func TestTheAlertRulesAndDashboardNameOnlyExportedMetrics(t *testing.T) {
	b, err := os.ReadFile(rules())
	if err != nil {
		t.Fatal(err)
	}
	dashboard, err := os.ReadFile(filepath.Join(envtest.RepoRoot(), "charts", "kvhandoff", "files", "dashboard.json"))
	if err != nil {
		t.Fatal(err)
	}
	if !json.Valid(dashboard) {
		t.Fatal("files/dashboard.json is not JSON")
	}
	b = append(b, dashboard...)
	exported := map[string]bool{}
	// A metric's name is spelled out where it is registered: prometheus.*Opts{Name: …}; the
	// engine choice's are a program's prefix (choice.Config{Metrics: …}) and a suffix of
	// choice.Assemble's table (c.Metrics + "…").
	registered := regexp.MustCompile(`Name:\s*"(kvhandoff_[a-z_]+)"`)
	prefixes := regexp.MustCompile(`Metrics:\s*"(kvhandoff_[a-z]+)"`)
	suffixes := regexp.MustCompile(`c\.Metrics \+ "(_[a-z_]+)"`)
	var pre, suf []string
	err = filepath.WalkDir(filepath.Join(envtest.RepoRoot(), "internal"), func(p string, d os.DirEntry, err error) error {
		if err != nil || d.IsDir() || !strings.HasSuffix(p, ".go") || strings.HasSuffix(p, "_test.go") {
			return err
		}
		src, err := os.ReadFile(p)
		for _, m := range registered.FindAllSubmatch(src, -1) {
			exported[string(m[1])] = true
		}
		for _, m := range prefixes.FindAllSubmatch(src, -1) {
			pre = append(pre, string(m[1]))
		}
		for _, m := range suffixes.FindAllSubmatch(src, -1) {
			suf = append(suf, string(m[1]))
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(pre) < 2 || len(suf) < 8 {
		t.Fatalf("the engine choice's metric names were not found: prefixes %v, suffixes %v", pre, suf)
	}
	for _, p := range pre {
		for _, s := range suf {
			exported[p+s] = true
		}
	}
	names := regexp.MustCompile(`kvhandoff_[a-z_]+`).FindAllString(string(b), -1)
	if len(names) == 0 {
		t.Fatal("the rules and dashboard name no kvhandoff metric")
	}
	for _, n := range names {
		base := regexp.MustCompile(`_(bucket|count|sum)$`).ReplaceAllString(n, "")
		if !exported[n] && !exported[base] {
			t.Errorf("the rules or the dashboard name %s, which no kvhandoff component exports", n)
		}
	}
}
