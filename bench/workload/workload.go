// Package workload is what both benchmarks offer the system under test: the fabric, the
// Poisson arrivals and their prompts, the engines' size and speed, and where they run.
package workload

import (
	"flag"
	"fmt"
	"io"
	"time"
)

// Load is the arrivals and engines a benchmark runs, the same in every mode it compares.
type Load struct {
	Provider     string
	QPS          float64
	PromptTokens int
	TP           int
	// Duration is how long requests arrive, per mode.
	Duration time.Duration
	// Utilisation sets prefill speed so the prefill engine is this busy
	// (docs/design.md#the-prefill-timing-model).
	Utilisation float64
	// CacheRequests sizes each engine rank's KV cache, in requests.
	CacheRequests int
	// Seed seeds the arrivals and prompts every mode replays.
	Seed uint64
}

// Default is the reference load: 8 QPS of 16k-token prompts at TP 8 on tcp;ofi_rxm, the
// prefill side 65% busy.
func Default() Load {
	return Load{Provider: "tcp;ofi_rxm", QPS: 8, PromptTokens: 16384, TP: 8, Duration: 20 * time.Second,
		Utilisation: 0.65, CacheRequests: 8, Seed: 1}
}

// Flags registers the load's flags on fs, with l's values as defaults.
func (l *Load) Flags(fs *flag.FlagSet) {
	fs.StringVar(&l.Provider, "provider", l.Provider, "libfabric provider")
	fs.Float64Var(&l.QPS, "qps", l.QPS, "Poisson arrival rate")
	fs.IntVar(&l.PromptTokens, "prompt-tokens", l.PromptTokens, "tokens per prompt")
	fs.IntVar(&l.TP, "tp", l.TP, "tensor-parallel size (engine ranks per side)")
	fs.DurationVar(&l.Duration, "duration", l.Duration, "how long requests arrive, per mode")
	fs.Float64Var(&l.Utilisation, "prefill-utilisation", l.Utilisation, "how busy the prefill engine is")
	fs.Uint64Var(&l.Seed, "seed", l.Seed, "seed of the arrivals and prompts every mode replays")
}

// Env is where a benchmark runs: the binaries it starts, its scratch folder, its log.
type Env struct {
	AgentBin string
	WorkDir  string
	Log      io.Writer
}

// Logf writes a line to the log, if there is one.
func (e Env) Logf(format string, args ...any) {
	if e.Log != nil {
		fmt.Fprintf(e.Log, format+"\n", args...)
	}
}
