package health

import (
	"context"
	"encoding/json"
	"log/slog"
	"slices"
	"time"
)

// Report is what a component says of its KV transfers in its annotation. Everything in
// it is stable while nothing changes (no counts, no times), so that publishing it only
// when it changes costs no API writes in a steady state, healthy or not.
type Report struct {
	// Provider is the libfabric provider the agent opened; empty when it could open none.
	Provider string `json:"provider,omitempty"`
	// Engines are the engine ids with a session at the agent, sorted.
	Engines []string `json:"engines,omitempty"`
	// Problem is a TransferHealthy reason of package v1alpha1 (AgentNotReady,
	// TransferFailures, ...); empty when the component sees nothing wrong.
	Problem string `json:"problem,omitempty"`
	// Message says what the component saw, for the condition's message.
	Message string `json:"message,omitempty"`
}

// Parse reads an annotation's value; ok is false when it is missing or not a Report.
func Parse(value string) (r Report, ok bool) {
	if value == "" {
		return r, false
	}
	return r, json.Unmarshal([]byte(value), &r) == nil
}

// Encode is the report as its annotation's value.
func (r Report) Encode() string {
	r.Engines = slices.Sorted(slices.Values(r.Engines)) // not the caller's slice
	b, _ := json.Marshal(r)                             // a struct of strings always marshals
	return string(b)
}

// Publisher writes a component's Report whenever it changes.
type Publisher struct {
	// Write stores the annotation's value (always a Report's JSON).
	Write func(ctx context.Context, value string) error
	// Every is how often the report is computed.
	Every time.Duration
	// MinInterval is the least time between two writes: a flapping problem costs at
	// most one write per MinInterval.
	MinInterval time.Duration
	Log         *slog.Logger

	last, lastProblem string
	written           time.Time
}

// Run computes the report every Every and writes it when it differs from the last one
// written, until ctx ends. A failed write is retried at the next tick.
func (p *Publisher) Run(ctx context.Context, report func(now time.Time) Report) {
	t := time.NewTicker(p.Every)
	defer t.Stop()
	for {
		p.Tick(ctx, report(time.Now()))
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// Tick writes r if it is new and the last write is at least MinInterval old; it reports
// whether it wrote.
func (p *Publisher) Tick(ctx context.Context, r Report) bool {
	value := r.Encode()
	if value == p.last || (!p.written.IsZero() && time.Since(p.written) < p.MinInterval) {
		return false
	}
	if err := p.Write(ctx, value); err != nil {
		if ctx.Err() == nil {
			p.Log.Error("publishing transfer health", "err", err)
		}
		return false
	}
	if p.last == "" || p.lastProblem != r.Problem {
		p.Log.Info("transfer health", "problem", r.Problem, "message", r.Message, "provider", r.Provider)
	}
	p.last, p.lastProblem, p.written = value, r.Problem, time.Now()
	return true
}
