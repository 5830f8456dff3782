package agent_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"

	"google.golang.org/grpc/codes"

	"github.com/kvhandoff/kvhandoff/test/simengine"
	agentv1 "github.com/kvhandoff/kvhandoff/transferagent/api/v1"
)

// hetero is a prefill engine of TP p on one node and a decode engine of TP d on another,
// of a model with 8 KV heads: each decode rank takes its heads from the prefill ranks
// that hold them, one transfer per rank pair (agentv1.Sources, PairRequestID).
type hetero struct {
	A, B *agentProc
	P, D []*simengine.Engine
	p, d uint32
	l    simengine.Layout // of rank 0 of TP 1: the model's
}

func newHetero(t *testing.T, mode agentv1.Mode, p, d int, agentArgs ...string) *hetero {
	return newHeteroOn(t, mode, p, d, startAgent(t, "prefill-node", t.TempDir(), agentArgs...),
		startAgent(t, "decode-node", t.TempDir(), agentArgs...), nil, nil)
}

// newHeteroOn starts the engines on agents a (prefill) and b (decode), their KV in host
// memory or, where a GPU is given, in that GPU's.
func newHeteroOn(t *testing.T, mode agentv1.Mode, p, d int, a, b *agentProc, prefillGPU, decodeGPU *int) *hetero {
	h := &hetero{A: a, B: b, p: uint32(p), d: uint32(d), l: testLayout(1, 128)}
	start := func(ag *agentProc, id string, role agentv1.Role, rank, tp int, gpu *int) *simengine.Engine {
		ctx, cancel := context.WithTimeout(bg, 30*time.Second)
		defer cancel()
		e, err := simengine.Start(ctx, simengine.Config{ID: id, Role: role, Mode: mode, Rank: rank, Layout: testLayout(tp, 128), Socket: ag.Socket, GPU: gpu})
		if err != nil {
			t.Fatalf("starting engine %s/%d: %v", id, rank, err)
		}
		t.Cleanup(e.Stop)
		return e
	}
	for r := range p {
		h.P = append(h.P, start(a, "prefill-0.default", agentv1.Role_ROLE_PREFILL, r, p, prefillGPU))
	}
	for r := range d {
		h.D = append(h.D, start(b, "decode-0.default", agentv1.Role_ROLE_DECODE, r, d, decodeGPU))
	}
	return h
}

// pairs is every rank pair of the engines, prefill rank first.
func (h *hetero) pairs(t *testing.T) [][2]uint32 {
	var out [][2]uint32
	for j := range h.d {
		src, err := agentv1.Sources(uint32(h.l.KVHeads), h.p, h.d, j)
		if err != nil {
			t.Fatal(err)
		}
		for _, i := range src {
			out = append(out, [2]uint32{i, j})
		}
	}
	return out
}

func (h *hetero) id(req string, pair [2]uint32) string {
	return agentv1.PairRequestID(req, pair[0], pair[1], h.p, h.d)
}

// sharedBytes is what a pair moves for n blocks: the heads both ranks hold, of every
// region.
func (h *hetero) sharedBytes(pair [2]uint32, n int) uint64 {
	a := agentv1.RankHeads(uint32(h.l.KVHeads), h.p, pair[0])
	b := agentv1.RankHeads(uint32(h.l.KVHeads), h.d, pair[1])
	return uint64(min(a.End(), b.End())-max(a.First, b.First)) * uint64(h.l.HeadBytes()*h.l.Regions()*n)
}

// handoff moves one request of n blocks the way mode says ("push", "push-layered" or
// "pull") and returns the decode ranks' blocks and each pair's two events.
func (h *hetero) handoff(t *testing.T, req, how string, n int) (dst [][]uint32, delivered, done map[[2]uint32]*agentv1.Event) {
	t.Helper()
	src := make([][]uint32, h.p)
	for i, e := range h.P {
		src[i] = alloc(t, e, n)
		e.Cache.Fill(req, src[i])
	}
	for _, e := range h.D {
		dst = append(dst, alloc(t, e, n))
	}
	pairs := h.pairs(t)
	if how != "pull" {
		for _, pr := range pairs {
			if err := h.D[pr[1]].RegisterDestination(bg, h.id(req, pr), 1, dst[pr[1]], h.P[pr[0]].Self); err != nil {
				t.Fatal(err)
			}
		}
	}
	for _, pr := range pairs {
		P, id := h.P[pr[0]], h.id(req, pr)
		var err error
		if how == "push-layered" {
			half := uint32(h.l.Regions() / 2)
			if err = P.SourceRegionsReady(bg, id, 0, half, src[pr[0]], false); err == nil {
				err = P.SourceRegionsReady(bg, id, half, half, src[pr[0]], true)
			}
		} else {
			err = P.SourceReady(bg, id, 0, src[pr[0]], true)
		}
		if err != nil {
			t.Fatal(err)
		}
		if how == "pull" {
			if err := h.D[pr[1]].Pull(bg, id, 1, P.Self, src[pr[0]], dst[pr[1]]); err != nil {
				t.Fatal(err)
			}
		}
	}
	delivered, done = map[[2]uint32]*agentv1.Event{}, map[[2]uint32]*agentv1.Event{}
	for _, pr := range pairs {
		delivered[pr] = wait(t, h.D[pr[1]], h.id(req, pr), 1)
		done[pr] = wait(t, h.P[pr[0]], h.id(req, pr), 1)
	}
	return dst, delivered, done
}

// Between engines of different tensor-parallel sizes, in both directions, every decode
// rank ends with exactly the KV heads it owns, byte for byte, and every pair's events
// count the bytes of the heads it moved: together, the request's KV once.
func TestDifferentTensorParallelSizesMoveEveryHeadOnce(t *testing.T) {
	providers := []string{provider(), "shm"}
	if provider() == "shm" {
		providers = providers[:1]
	}
	for _, fab := range providers {
		for _, how := range []string{"push", "push-layered", "pull"} {
			for _, c := range [][2]int{{1, 2}, {1, 4}, {2, 1}, {4, 1}, {2, 4}, {4, 2}, {8, 2}} {
				t.Run(fmt.Sprintf("%s/%s/%d→%d", fab, how, c[0], c[1]), func(t *testing.T) {
					h := newHetero(t, modeOf(how), c[0], c[1], "--provider", fab)
					h.check(t, how)
				})
			}
		}
	}
}

func modeOf(how string) agentv1.Mode {
	if how == "pull" {
		return agentv1.Mode_MODE_PULL
	}
	return agentv1.Mode_MODE_PUSH
}

// check hands one request over and checks that every decode rank holds exactly its heads
// and that each pair's events count the bytes of the heads it moved: together, the
// request's KV once.
func (h *hetero) check(t *testing.T, how string) {
	t.Helper()
	const n = 9
	dst, delivered, done := h.handoff(t, "hetero", how, n)
	var total uint64
	for pr, ev := range delivered {
		expect(t, ev, agentv1.Event_DELIVERED)
		expect(t, done[pr], agentv1.Event_SOURCE_DONE)
		// Both ends count what the pair moved: a pull's source its reader's heads.
		if want := h.sharedBytes(pr, n); ev.Bytes != want || done[pr].Bytes != want {
			t.Errorf("pair %v: delivered %d bytes, source done %d, want %d", pr, ev.Bytes, done[pr].Bytes, want)
		}
		total += ev.Bytes
	}
	if want := uint64(n * h.l.BlockBytes() * h.l.Regions()); total != want {
		t.Errorf("the pairs moved %d bytes, the request's KV is %d", total, want)
	}
	for j, e := range h.D {
		if err := e.Cache.Verify("hetero", dst[j]); err != nil {
			t.Errorf("decode rank %d: %v", j, err)
		}
	}
}

// A decode engine that cancels a request cancels each of its pairs; the retry's pairs
// land whole, and nothing of the cancelled attempt lands after its acknowledgement.
func TestACancelOfAPairedRequestAndItsRetry(t *testing.T) {
	h := newHetero(t, agentv1.Mode_MODE_PUSH, 4, 2)
	const req, n = "cancelled", 6
	src := make([][]uint32, h.p)
	for i, e := range h.P {
		src[i] = alloc(t, e, n)
		e.Cache.Fill(req, src[i])
	}
	first := [][]uint32{alloc(t, h.D[0], n), alloc(t, h.D[1], n)}
	for _, pr := range h.pairs(t) {
		if err := h.D[pr[1]].RegisterDestination(bg, h.id(req, pr), 1, first[pr[1]], h.P[pr[0]].Self); err != nil {
			t.Fatal(err)
		}
	}
	for _, pr := range h.pairs(t) {
		if err := h.D[pr[1]].Cancel(bg, h.id(req, pr), 1); err != nil {
			t.Fatal(err)
		}
		expect(t, wait(t, h.D[pr[1]], h.id(req, pr), 1), agentv1.Event_CANCEL_ACKED)
	}
	for j, e := range h.D {
		sentinel(t, e, first[j])
	}
	retry := [][]uint32{alloc(t, h.D[0], n), alloc(t, h.D[1], n)}
	for _, pr := range h.pairs(t) {
		if err := h.D[pr[1]].RegisterDestination(bg, h.id(req, pr), 2, retry[pr[1]], h.P[pr[0]].Self); err != nil {
			t.Fatal(err)
		}
		if err := h.P[pr[0]].SourceReady(bg, h.id(req, pr), 0, src[pr[0]], true); err != nil {
			t.Fatal(err)
		}
	}
	for _, pr := range h.pairs(t) {
		expect(t, wait(t, h.D[pr[1]], h.id(req, pr), 2), agentv1.Event_DELIVERED)
		expect(t, wait(t, h.P[pr[0]], h.id(req, pr), 2), agentv1.Event_SOURCE_DONE)
	}
	for j, e := range h.D {
		if err := e.Cache.Verify(req, retry[j]); err != nil {
			t.Errorf("decode rank %d: %v", j, err)
		}
		untouched(t, e, first[j])
	}
}

// A decode rank lost mid-transfer fails its pairs on the prefill side (the engine frees
// those blocks); the other decode ranks' pairs are delivered whole.
func TestADecodeRankLostMidTransfer(t *testing.T) {
	h := newHetero(t, agentv1.Mode_MODE_PUSH, 1, 4)
	const req, n = "lost", 64
	src := alloc(t, h.P[0], n)
	h.P[0].Cache.Fill(req, src)
	dst := make([][]uint32, h.d)
	for _, pr := range h.pairs(t) {
		dst[pr[1]] = alloc(t, h.D[pr[1]], n)
		if err := h.D[pr[1]].RegisterDestination(bg, h.id(req, pr), 1, dst[pr[1]], h.P[0].Self); err != nil {
			t.Fatal(err)
		}
	}
	const lost = 2
	for _, pr := range h.pairs(t) {
		if err := h.P[0].SourceReady(bg, h.id(req, pr), 0, src, true); err != nil {
			t.Fatal(err)
		}
		if pr[1] == 1 {
			h.D[lost].Stop()
		}
	}
	for _, pr := range h.pairs(t) {
		ev := wait(t, h.P[0], h.id(req, pr), 1)
		if pr[1] == lost {
			expect(t, ev, agentv1.Event_FAILED)
			continue
		}
		expect(t, ev, agentv1.Event_SOURCE_DONE)
		expect(t, wait(t, h.D[pr[1]], h.id(req, pr), 1), agentv1.Event_DELIVERED)
		if err := h.D[pr[1]].Cache.Verify(req, dst[pr[1]]); err != nil {
			t.Errorf("decode rank %d: %v", pr[1], err)
		}
	}
}

// A pair of ranks that share no KV head is refused at the call, naming the rank.
func TestAPairSharingNoHeadIsRefused(t *testing.T) {
	h := newHetero(t, agentv1.Mode_MODE_PUSH, 2, 4)
	blocks := alloc(t, h.D[3], 2)
	wrong := proto.Clone(h.P[0].Self).(*agentv1.EngineRef) // holds heads 0-3; decode rank 3 holds 6 and 7
	refused(t, "a source holding none of the rank's heads", h.D[3].RegisterDestination(bg, "r#0>3", 1, blocks, wrong),
		codes.InvalidArgument, "source.tp_rank")
}
