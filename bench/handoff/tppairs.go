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

// TPPair is one pair of tensor-parallel sizes in the TP-pairs run, and what it measured.
type TPPair struct {
	Prefill int `json:"prefill_tp"`
	Decode  int `json:"decode_tp"`
	// Pairs is how many rank pairs move the request (agentv1.Sources), WritesPerPair how
	// many writes each posted (its SOURCE_DONE's descriptors).
	Pairs         int `json:"pairs"`
	WritesPerPair int `json:"writes_per_pair"`
	// HandoffMs is the first prefill rank's report to the last decode rank's DELIVERED.
	HandoffMs report.Percentiles `json:"handoff_ms"`
	// WireFloorMs is the request's bytes over Pairs endpoint pairs at once, each in
	// WritesPerPair writes (the handoff's own parallelism and descriptors);
	// WireFloorMergedMs the same bytes in one write per region per pair (what equal
	// sizes post when the blocks are contiguous).
	WireFloorMs       float64 `json:"wire_floor_ms"`
	WireFloorMergedMs float64 `json:"wire_floor_merged_ms"`
	Handoffs          int     `json:"handoffs"`
}

// TPPairsReport is what TPPairs measured.
type TPPairsReport struct {
	Provider string   `json:"provider"`
	Model    string   `json:"model"`
	Tokens   int      `json:"tokens_per_request"`
	Bytes    int      `json:"bytes_per_request"`
	CPUs     int      `json:"cpus"`
	Pairs    []TPPair `json:"pairs"`
}

// TPPairs measures one request's push handoff between engines of each pair of
// tensor-parallel sizes (prefill, decode) of the same Qwen3-32B-shaped model: n handoffs
// of a request of tokens tokens, one at a time, every byte verified, each pair of sizes on
// fresh agents. Blocks are contiguous on both sides, so equal sizes merge each rank's
// blocks into one write per region while different sizes write each block's shared heads
// on their own: the floors say what that costs on the wire.
func TPPairs(ctx context.Context, bin, dir, provider string, sizes [][2]int, tokens, n int) (*TPPairsReport, error) {
	model := simengine.Qwen3_32B(1, 0)
	blocks := tokens / model.BlockSize
	rep := &TPPairsReport{Provider: provider, Model: "Qwen3-32B (64 layers, 8 KV heads × 128, bf16)", Tokens: blocks * model.BlockSize,
		Bytes: blocks * model.BytesPerToken() * model.BlockSize, CPUs: runtime.NumCPU()}
	for _, sz := range sizes {
		r, err := tpPair(ctx, bin, filepath.Join(dir, fmt.Sprintf("tp%d-tp%d", sz[0], sz[1])), provider, sz[0], sz[1], blocks, n)
		if err != nil {
			return nil, fmt.Errorf("TP%d→TP%d: %w", sz[0], sz[1], err)
		}
		if r.WireFloorMs, err = floorMs(provider, rep.Bytes, r.Pairs, r.WritesPerPair); err != nil {
			return nil, err
		}
		if r.WireFloorMergedMs, err = floorMs(provider, rep.Bytes, r.Pairs, model.Regions()); err != nil {
			return nil, err
		}
		rep.Pairs = append(rep.Pairs, *r)
	}
	return rep, nil
}

func floorMs(provider string, bytes, pairs, writes int) (float64, error) {
	d, err := wireFloorParallel(provider, 1, bytes, pairs, writes, nil)
	return ms(d), err
}

func tpPair(ctx context.Context, bin, dir, provider string, p, d, blocks, n int) (*TPPair, error) {
	a, b, err := agentproc.StartPair(bin, dir, provider)
	if err != nil {
		return nil, err
	}
	defer a.Stop()
	defer b.Stop()
	heads := uint32(simengine.Qwen3_32B(1, 0).KVHeads)
	start := func(ag *agentproc.Proc, id string, role agentv1.Role, tp int) ([]*simengine.Engine, error) {
		var out []*simengine.Engine
		for r := range tp {
			e, err := simengine.Start(ctx, simengine.Config{ID: id, Role: role, Mode: agentv1.Mode_MODE_PUSH, Rank: r, Layout: simengine.Qwen3_32B(tp, blocks),
				Socket: ag.Socket})
			if err != nil {
				return out, err // the caller stops those started
			}
			out = append(out, e)
		}
		return out, nil
	}
	P, err := start(a, "tp-prefill", agentv1.Role_ROLE_PREFILL, p)
	for _, e := range P {
		defer e.Stop()
	}
	if err != nil {
		return nil, err
	}
	D, err := start(b, "tp-decode", agentv1.Role_ROLE_DECODE, d)
	for _, e := range D {
		defer e.Stop()
	}
	if err != nil {
		return nil, err
	}
	var pairs [][2]uint32
	for j := range uint32(d) {
		src, err := agentv1.Sources(heads, uint32(p), uint32(d), j)
		if err != nil {
			return nil, err
		}
		for _, i := range src {
			pairs = append(pairs, [2]uint32{i, j})
		}
	}
	ids := make([]uint32, blocks)
	for i := range ids {
		ids[i] = uint32(i)
	}
	out := &TPPair{Prefill: p, Decode: d, Pairs: len(pairs)}
	var took []float64
	for k := range n {
		req := fmt.Sprintf("tp-%d", k)
		pairID := func(pr [2]uint32) string { return agentv1.PairRequestID(req, pr[0], pr[1], uint32(p), uint32(d)) }
		for _, e := range P {
			e.Cache.Fill(req, ids)
		}
		for _, pr := range pairs {
			if err := D[pr[1]].RegisterDestination(ctx, pairID(pr), 1, ids, P[pr[0]].Self); err != nil {
				return nil, err
			}
		}
		begin := time.Now()
		for _, pr := range pairs {
			if err := P[pr[0]].SourceReady(ctx, pairID(pr), 0, ids, true); err != nil {
				return nil, err
			}
		}
		wctx, cancel := context.WithTimeout(ctx, time.Minute)
		for _, pr := range pairs {
			if ev, err := D[pr[1]].Wait(wctx, pairID(pr), 1); err != nil || ev.Type != agentv1.Event_DELIVERED {
				cancel()
				return nil, fmt.Errorf("pair %v of %s: %v %v", pr, req, ev, err)
			}
		}
		took = append(took, ms(time.Since(begin)))
		for _, pr := range pairs {
			ev, err := P[pr[0]].Wait(wctx, pairID(pr), 1)
			if err != nil || ev.Type != agentv1.Event_SOURCE_DONE {
				cancel()
				return nil, fmt.Errorf("pair %v of %s: prefill got %v %v", pr, req, ev, err)
			}
			out.WritesPerPair = int(ev.Descriptors)
		}
		cancel()
		for _, e := range D {
			if err := e.Cache.Verify(req, ids); err != nil {
				return nil, err
			}
		}
	}
	out.HandoffMs, out.Handoffs = report.Of(took), len(took)
	return out, nil
}

// Markdown writes the report as a table, each handoff against its floors.
func (r *TPPairsReport) Markdown(w io.Writer) {
	fmt.Fprintf(w, "One %d-token request of %s (%.0f MiB of KV) pushed between engines of each pair of tensor-parallel sizes, host memory over "+
		"provider `%s`, %d CPUs, %d handoffs each, one at a time.\n\n", r.Tokens, r.Model, float64(r.Bytes)/(1<<20), r.Provider, r.CPUs, r.Pairs[0].Handoffs)
	fmt.Fprintln(w, "| prefill → decode | rank pairs | writes per pair | handoff p50 / p90 (ms) | floor, same writes (ms) | handoff / floor | floor, merged writes (ms) |")
	fmt.Fprintln(w, "|---|---|---|---|---|---|---|")
	for _, p := range r.Pairs {
		fmt.Fprintf(w, "| TP%d → TP%d | %d | %d | %.1f / %.1f | %.1f | %.2f× | %.1f |\n", p.Prefill, p.Decode, p.Pairs, p.WritesPerPair,
			p.HandoffMs.P50, p.HandoffMs.P90, p.WireFloorMs, p.HandoffMs.P50/p.WireFloorMs, p.WireFloorMergedMs)
	}
}

// Write puts the report in out/tp-pairs.json.
func (r *TPPairsReport) Write(out string) error {
	b, err := json.MarshalIndent(r, "", "  ")
	if err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(out, "tp-pairs.json"), append(b, '\n'), 0o644)
}
