package handoff

import (
	"context"
	"fmt"
	"io"
	"time"

	"github.com/kvhandoff/kvhandoff/test/agentproc"
	"github.com/kvhandoff/kvhandoff/test/simengine"
	agentv1 "github.com/kvhandoff/kvhandoff/transferagent/api/v1"
)

// Demo starts two agents on loopback, a prefill and a decode engine on them, and pushes
// one request's KV (Qwen3-32B's layout at TP 8, one rank, 1k tokens) through them,
// verifying every byte. It narrates what happens to w.
func Demo(ctx context.Context, bin, dir, provider string, w io.Writer) error {
	a, b, err := agentproc.StartPair(bin, dir, provider)
	if err != nil {
		return err
	}
	defer a.Stop()
	defer b.Stop()
	fmt.Fprintf(w, "  agents: prefill node %s, decode node %s, provider %s\n", a.Peer, b.Peer, provider)
	l := simengine.Qwen3_32B(8, 256)
	P, err := simengine.Start(ctx, simengine.Config{ID: "qwen3-32b-prefill-0.default", Role: agentv1.Role_ROLE_PREFILL,
		Mode: agentv1.Mode_MODE_PUSH, Layout: l, Socket: a.Socket})
	if err != nil {
		return err
	}
	defer P.Stop()
	D, err := simengine.Start(ctx, simengine.Config{ID: "qwen3-32b-decode-0.default", Role: agentv1.Role_ROLE_DECODE,
		Mode: agentv1.Mode_MODE_PUSH, Layout: l, Socket: b.Socket})
	if err != nil {
		return err
	}
	defer D.Stop()
	const tokens = 1024
	n := tokens / l.BlockSize
	src, _ := P.Allocate(n)
	dst, _ := D.Allocate(n)
	fmt.Fprintf(w, "  decode registers %d blocks × %d regions (%d KiB) for request demo-1, naming prefill rank %s/%d\n",
		n, l.Regions(), n*l.Regions()*l.BlockBytes()>>10, P.Self.EngineId, P.Self.TpRank)
	if err := D.RegisterDestination(ctx, "demo-1", 1, dst, P.Self); err != nil {
		return err
	}
	P.Cache.Fill("demo-1", src)
	start := time.Now()
	if err := P.SourceReady(ctx, "demo-1", 0, src, true); err != nil {
		return err
	}
	fmt.Fprintln(w, "  prefill finished and reported its blocks ready; the prefill agent writes into decode's memory")
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	ev, err := D.Wait(wctx, "demo-1", 1)
	if err != nil {
		return err
	}
	if ev.Type != agentv1.Event_DELIVERED {
		return fmt.Errorf("decode got %s: %s", ev.Type, ev.Reason)
	}
	took := time.Since(start)
	done, err := P.Wait(wctx, "demo-1", 1)
	if err != nil {
		return err
	}
	if err := D.Cache.Verify("demo-1", dst); err != nil {
		return err
	}
	fmt.Fprintf(w, "  decode: %s after %.1f ms, %d bytes, every byte verified\n", ev.Type, float64(took.Microseconds())/1000, ev.Bytes)
	fmt.Fprintf(w, "  prefill: %s, %d RMA writes after merging %d blocks × %d regions\n", done.Type, done.Descriptors, n, l.Regions())
	return nil
}
