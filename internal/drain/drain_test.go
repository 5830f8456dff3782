package drain

import (
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"testing"
)

// What the engine reports counts as idle only when it is a count of zero: NaN, infinite,
// negative or unreadable counts are busy (a NaN once read as idle, and the engine was
// stopped with requests in flight).
func TestOnlyACountOfZeroIsIdle(t *testing.T) {
	for _, c := range []struct {
		running, held string
		busy          bool
	}{
		{"0", "0", false},
		{"2", "0", true},
		{"0", "1", true},
		{"NaN", "0", true},
		{"+Inf", "0", true},
		{"-Inf", "0", true},
		{"-5", "3", true},
		{"0", "-1", true},
		{"x", "0", true},
	} {
		engine := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
			_, _ = w.Write([]byte("# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{engine=\"0\"} " + c.running + "\nvllm:num_requests_waiting{engine=\"0\"} 0\n"))
		}))
		held := filepath.Join(t.TempDir(), "held")
		_ = os.WriteFile(held, []byte(c.held+"\n"), 0o644)
		busy, what := holds(t.Context(), engine.Client(), Config{MetricsURL: engine.URL, HeldFile: held})
		engine.Close()
		if busy != c.busy {
			t.Errorf("running %s, held %s: busy %v (%s), want %v", c.running, c.held, busy, what, c.busy)
		}
	}
}
