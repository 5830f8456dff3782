package handoff

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"time"

	"github.com/kvhandoff/kvhandoff/bench/report"
	"github.com/kvhandoff/kvhandoff/test/agentproc"
	"github.com/kvhandoff/kvhandoff/test/simengine"
	agentv1 "github.com/kvhandoff/kvhandoff/transferagent/api/v1"
)

// FixedPath is one way of handing off in the fixed-cost run, and what it measured.
type FixedPath struct {
	Name     string `json:"name"`
	Doorbell bool   `json:"doorbell"`
	// DeliveredMs is the prefill engine's report of its blocks to the decode engine's
	// DELIVERED (for pull the decode engine pulls at once after the report); SourceDoneMs
	// to the prefill engine's SOURCE_DONE.
	DeliveredMs  report.Percentiles `json:"delivered_ms"`
	SourceDoneMs report.Percentiles `json:"source_done_ms"`
	Handoffs     int                `json:"handoffs"`
}

// FixedCostReport is what FixedCost measured.
type FixedCostReport struct {
	GPU      int         `json:"gpu"` // -1: host memory over the fabric
	Provider string      `json:"provider"`
	Bytes    int         `json:"bytes_per_handoff"`
	CPUs     int         `json:"cpus"`
	Paths    []FixedPath `json:"paths"`
}

// FixedCost measures what a handoff costs beyond its bytes: n handoffs of a few blocks
// each (so the wire takes microseconds) along each path — push and pull, with the
// engines' reports and events over gRPC and over doorbells — interleaved one of each in
// turn, so every path sees the same machine. Every handoff's bytes are verified. With gpu
// ≥ 0 both engines keep their KV on that GPU and share one agent, which moves it by CUDA
// copies; otherwise they are on two agents over the fabric.
func FixedCost(ctx context.Context, bin, dir, provider string, n, gpu int) (*FixedCostReport, error) {
	a, b, err := agentproc.StartPair(bin, dir, provider)
	if err != nil {
		return nil, err
	}
	defer a.Stop()
	defer b.Stop()
	var onGPU *int
	if gpu >= 0 {
		onGPU, b = &gpu, a
	}
	l := simengine.Layout{Layers: 2, BlockSize: 16, KVHeads: 8, HeadDim: 16, DTypeBytes: 2, TP: 1, Blocks: 64}
	const blocks = 4
	rep := &FixedCostReport{GPU: gpu, Provider: provider, Bytes: blocks * l.Regions() * l.BlockBytes(), CPUs: runtime.NumCPU()}
	type path struct {
		FixedPath
		mode       agentv1.Mode
		P, D       *simengine.Engine
		done, dlvd []float64
	}
	var paths []*path
	for _, mode := range []agentv1.Mode{agentv1.Mode_MODE_PUSH, agentv1.Mode_MODE_PULL} {
		for _, bell := range []bool{false, true} {
			name := map[agentv1.Mode]string{agentv1.Mode_MODE_PUSH: "push", agentv1.Mode_MODE_PULL: "pull"}[mode]
			name += map[bool]string{false: " (gRPC)", true: " (doorbell)"}[bell]
			p := &path{FixedPath: FixedPath{Name: name, Doorbell: bell}, mode: mode}
			id := fmt.Sprintf("fixed-%d", len(paths))
			if p.P, err = simengine.Start(ctx, simengine.Config{ID: id + "-prefill", Role: agentv1.Role_ROLE_PREFILL, Mode: mode, Layout: l, Socket: a.Socket, Doorbell: bell, GPU: onGPU}); err != nil {
				return nil, err
			}
			defer p.P.Stop()
			if p.D, err = simengine.Start(ctx, simengine.Config{ID: id + "-decode", Role: agentv1.Role_ROLE_DECODE, Mode: mode, Layout: l, Socket: b.Socket, Doorbell: bell, GPU: onGPU}); err != nil {
				return nil, err
			}
			defer p.D.Stop()
			paths = append(paths, p)
		}
	}
	for i := range n {
		for _, p := range paths {
			req := fmt.Sprintf("fixed-%d", i)
			src, err := p.P.Allocate(blocks)
			if err != nil {
				return nil, err
			}
			dst, err := p.D.Allocate(blocks)
			if err != nil {
				return nil, err
			}
			p.P.Cache.Fill(req, src)
			if p.mode == agentv1.Mode_MODE_PUSH {
				if err := p.D.RegisterDestination(ctx, req, 1, dst, p.P.Self); err != nil {
					return nil, err
				}
			}
			start := time.Now()
			if err := p.P.SourceReady(ctx, req, 0, src, true); err != nil {
				return nil, err
			}
			if p.mode == agentv1.Mode_MODE_PULL {
				if err := p.D.Pull(ctx, req, 1, p.P.Self, src, dst); err != nil {
					return nil, err
				}
			}
			wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
			ev, err := p.D.Wait(wctx, req, 1)
			delivered := time.Since(start)
			if err == nil && ev.Type != agentv1.Event_DELIVERED {
				err = fmt.Errorf("%s %s: %s %s", p.Name, req, ev.Type, ev.Reason)
			}
			var sev *agentv1.Event
			if err == nil {
				sev, err = p.P.Wait(wctx, req, 1)
			}
			done := time.Since(start)
			cancel()
			if err == nil && sev.Type != agentv1.Event_SOURCE_DONE {
				err = fmt.Errorf("%s %s: prefill got %s %s", p.Name, req, sev.Type, sev.Reason)
			}
			if err == nil {
				err = p.D.Cache.Verify(req, dst)
			}
			if err != nil {
				return nil, err
			}
			p.dlvd, p.done = append(p.dlvd, ms(delivered)), append(p.done, ms(done))
			p.P.Free(src)
			p.D.Free(dst)
		}
	}
	for _, p := range paths {
		p.DeliveredMs, p.SourceDoneMs, p.Handoffs = report.Of(p.dlvd), report.Of(p.done), len(p.dlvd)
		rep.Paths = append(rep.Paths, p.FixedPath)
	}
	return rep, nil
}

// Markdown writes the report as a table, with each doorbell path against its gRPC one.
func (r *FixedCostReport) Markdown(w io.Writer) {
	where := fmt.Sprintf("host memory over provider `%s`", r.Provider)
	if r.GPU >= 0 {
		where = fmt.Sprintf("GPU %d memory, one agent, CUDA copies", r.GPU)
	}
	fmt.Fprintf(w, "Fixed cost per handoff: %d bytes each, %s, %d CPUs; paths interleaved one handoff each in turn.\n\n", r.Bytes, where, r.CPUs)
	fmt.Fprintln(w, "| path | handoffs | report → DELIVERED p50 / p90 / p99 (ms) | report → SOURCE_DONE p50 / p90 / p99 (ms) | p50 against gRPC |")
	fmt.Fprintln(w, "|---|---|---|---|---|")
	for i, p := range r.Paths {
		ratio := "—"
		if p.Doorbell && i > 0 && r.Paths[i-1].DeliveredMs.P50 > 0 {
			ratio = fmt.Sprintf("%.2f×", p.DeliveredMs.P50/r.Paths[i-1].DeliveredMs.P50)
		}
		fmt.Fprintf(w, "| %s | %d | %.3f / %.3f / %.3f | %.3f / %.3f / %.3f | %s |\n", p.Name, p.Handoffs,
			p.DeliveredMs.P50, p.DeliveredMs.P90, p.DeliveredMs.P99, p.SourceDoneMs.P50, p.SourceDoneMs.P90, p.SourceDoneMs.P99, ratio)
	}
}

// Write puts the report in out/fixed-cost.json.
func (r *FixedCostReport) Write(out string) error {
	b, err := json.MarshalIndent(r, "", "  ")
	if err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(out, "fixed-cost.json"), append(b, '\n'), 0o644)
}
