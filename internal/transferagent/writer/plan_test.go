package writer

import (
	"strings"
	"testing"

	"github.com/kvhandoff/kvhandoff/internal/transferagent/rendezvous"
	agentv1 "github.com/kvhandoff/kvhandoff/transferagent/api/v1"
)

func regions(n int, blockLen uint64, blocks uint32) []Region {
	out := make([]Region, n)
	for i := range out {
		out[i] = Region{ID: i, BlockLen: blockLen, Blocks: blocks}
	}
	return out
}

func transfer(src, dst []uint32) rendezvous.Transfer {
	return rendezvous.Transfer{Request: "r", Attempt: 1, Src: src, Dst: dst}
}

// seq is the n block ids from, from+1, ….
func seq(from, n uint32) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = from + uint32(i)
	}
	return out
}

func TestPlanMergesContiguousRunsIntoOneWritePerRunAndRegion(t *testing.T) {
	// Qwen3-32B at TP8 on one rank: 64 layers × K,V = 128 regions of 4 KiB blocks; a
	// 16k-token request is 1024 blocks, ~131k descriptors unmerged.
	src, dst := regions(128, 4096, 4096), regions(128, 4096, 4096)
	w, err := Plan(transfer(seq(0, 1024), seq(2000, 1024)), src, dst, 1<<30, Slice{})
	if err != nil {
		t.Fatal(err)
	}
	if len(w) != 128 {
		t.Fatalf("%d writes for one contiguous run in 128 regions, want 128", len(w))
	}
	if w[5] != (Write{Region: 5, SrcOff: 0, DstOff: 2000 * 4096, Len: 1024 * 4096, Blocks: 1024}) {
		t.Fatalf("write %+v", w[5])
	}
}

func TestPlanCountsOneWritePerContiguousRun(t *testing.T) {
	// Runs: 0-2 → 10-12; 5 → 13 (the source breaks); 6-8 → 20-22 (the destination breaks
	// between 5 → 13 and 6 → 20).
	src := []uint32{0, 1, 2, 5, 6, 7, 8}
	dst := []uint32{10, 11, 12, 13, 20, 21, 22}
	w, err := Plan(transfer(src, dst), regions(2, 16, 64), regions(2, 16, 64), 1<<20, Slice{})
	if err != nil {
		t.Fatal(err)
	}
	if len(w) != 2*3 {
		t.Fatalf("%d writes, want 3 runs × 2 regions: %+v", len(w), w)
	}
	blocks := 0
	for _, x := range w {
		blocks += x.Blocks
	}
	if blocks != 2*len(src) {
		t.Fatalf("writes cover %d blocks, want %d", blocks, 2*len(src))
	}
}

// An engine that freed a request's blocks tail first hands them out again in descending
// order, on both sides: in position order no two pairs are adjacent, in source order the
// whole request is one run. The caller's slices keep their order.
func TestPlanMergesRunsThatPositionOrderHides(t *testing.T) {
	src, dst := make([]uint32, 1024), make([]uint32, 1024)
	for i := range src {
		src[i], dst[i] = uint32(3000-i), uint32(5000-i)
	}
	w, err := Plan(transfer(src, dst), regions(72, 32<<10, 8192), regions(72, 32<<10, 8192), 1<<30, Slice{})
	if err != nil {
		t.Fatal(err)
	}
	if len(w) != 72 {
		t.Fatalf("%d writes, want one run in each of 72 regions", len(w))
	}
	if w[0] != (Write{Region: 0, SrcOff: 1977 * 32 << 10, DstOff: 3977 * 32 << 10, Len: 1024 * 32 << 10, Blocks: 1024}) {
		t.Fatalf("write %+v", w[0])
	}
	if src[0] != 3000 || dst[0] != 5000 {
		t.Fatalf("Plan reordered its caller's pairs: %d → %d first", src[0], dst[0])
	}
}

func TestPlanSplitsAtTheProviderMessageSize(t *testing.T) {
	w, err := Plan(transfer(seq(0, 10), seq(0, 10)), regions(1, 1000, 16), regions(1, 1000, 16), 3500, Slice{})
	if err != nil {
		t.Fatal(err)
	}
	if len(w) != 4 || w[0].Len != 3000 || w[3].Blocks != 1 {
		t.Fatalf("%+v: want writes of 3, 3, 3 and 1 blocks", w)
	}
}

func TestPlanRefusesOutOfBoundsOrMismatchedRegionsWhole(t *testing.T) {
	for name, c := range map[string]struct {
		t        rendezvous.Transfer
		src, dst []Region
		want     string
	}{
		"source block past the region":      {transfer([]uint32{0, 64}, []uint32{0, 1}), regions(1, 16, 64), regions(1, 16, 128), "outside region 0"},
		"destination block past the region": {transfer([]uint32{0, 1}, []uint32{0, 200}), regions(1, 16, 64), regions(1, 16, 128), "outside region 0"},
		"block length differs":              {transfer([]uint32{0}, []uint32{0}), regions(1, 16, 64), regions(1, 32, 64), "does not match"},
		"region missing at the destination": {transfer([]uint32{0}, []uint32{0}), regions(2, 16, 64), regions(1, 16, 64), "region 1 does not match"},
		"uneven pairs": {rendezvous.Transfer{Src: []uint32{0, 1}, Dst: []uint32{0}}, regions(1, 16, 64),
			regions(1, 16, 64), "2 source blocks for 1"},
	} {
		w, err := Plan(c.t, c.src, c.dst, 1<<20, Slice{})
		if err == nil || !strings.Contains(err.Error(), c.want) || w != nil {
			t.Errorf("%s: %v, %d writes; want an error containing %q and no writes", name, err, len(w), c.want)
		}
	}
}

// BenchmarkPlan16kTokens plans a 16k-token Qwen3-32B request on one TP8 rank: 1024
// blocks in 128 regions, as two runs.
func BenchmarkPlan16kTokens(b *testing.B) {
	src, dst := regions(128, 4096, 8192), regions(128, 4096, 8192)
	t := transfer(append(seq(0, 512), seq(2000, 512)...), seq(4000, 1024))
	for b.Loop() {
		if _, err := Plan(t, src, dst, 1<<30, Slice{}); err != nil {
			b.Fatal(err)
		}
	}
}

// Between ranks of different tensor-parallel sizes each block moves only the heads both
// hold: a decode rank of TP 2 takes its half of a TP 1 block, a TP 1 decode rank takes
// each TP 2 prefill rank's whole block into its half, one write per block and region.
func TestPlanMovesTheHeadsBothRanksHold(t *testing.T) {
	const head = 512
	whole, half := regions(2, 2*head, 64), regions(2, head, 64)
	for _, c := range []struct {
		name     string
		src, dst agentv1.Heads
		srcR     []Region
		dstR     []Region
		srcOff   uint64 // of block 3's slice
		dstOff   uint64 // of block 9's slice
	}{
		{"1→2, decode rank 1", agentv1.Heads{First: 0, Count: 2}, agentv1.Heads{First: 1, Count: 1}, whole, half, 3*2*head + head, 9 * head},
		{"2→1, prefill rank 1", agentv1.Heads{First: 1, Count: 1}, agentv1.Heads{First: 0, Count: 2}, half, whole, 3 * head, 9*2*head + head},
	} {
		t.Run(c.name, func(t *testing.T) {
			sl, err := HeadSlice(c.src, c.dst, head)
			if err != nil {
				t.Fatal(err)
			}
			w, err := Plan(transfer([]uint32{3, 4}, []uint32{9, 10}), c.srcR, c.dstR, 1<<20, sl)
			if err != nil {
				t.Fatal(err)
			}
			if len(w) != 4 {
				t.Fatalf("%d writes, want one per block and region (4): %+v", len(w), w)
			}
			if w[0].SrcOff != c.srcOff || w[0].DstOff != c.dstOff || w[0].Len != head || w[0].Blocks != 1 {
				t.Errorf("first write %+v, want %d→%d of %d bytes", w[0], c.srcOff, c.dstOff, head)
			}
		})
	}
	if _, err := HeadSlice(agentv1.Heads{First: 0, Count: 1}, agentv1.Heads{First: 1, Count: 1}, head); err == nil {
		t.Error("ranks sharing no head: a slice")
	}
	if sl, _ := HeadSlice(agentv1.Heads{First: 2, Count: 2}, agentv1.Heads{First: 2, Count: 2}, head); sl != (Slice{}) {
		t.Errorf("equal ranks: slice %+v, want whole blocks", sl)
	}
	sl, _ := HeadSlice(agentv1.Heads{First: 0, Count: 2}, agentv1.Heads{First: 1, Count: 1}, head)
	if _, err := Plan(transfer([]uint32{0}, []uint32{0}), half, half, 1<<20, sl); err == nil {
		t.Error("a slice beyond the source's blocks was planned")
	}
}
