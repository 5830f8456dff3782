// Package writer turns the rendezvous table's transfers into RMA writes: it maps block ids
// to offsets in every KV region, merges contiguous runs into the largest writes the
// provider accepts, and drives them through the fabric under the table's fence.
package writer

import (
	"cmp"
	"fmt"
	"slices"

	"github.com/kvhandoff/kvhandoff/internal/transferagent/rendezvous"
	agentv1 "github.com/kvhandoff/kvhandoff/transferagent/api/v1"
)

// Region is one registered KV region as the writer sees it: vLLM keeps one per layer and
// K/V on each TP rank, each an array of equally sized blocks indexed by block id.
type Region struct {
	// ID names the region; a source region is written into the destination region with
	// the same ID.
	ID       int
	BlockLen uint64
	Blocks   uint32
}

// Write is one RMA write: Len bytes from SrcOff of source region Region to DstOff of the
// destination region with the same ID. It covers Blocks blocks of the transfer.
type Write struct {
	Region         int
	SrcOff, DstOff uint64
	Len            uint64
	Blocks         int
}

// Slice is the part of every block that moves between two ranks holding different KV
// heads (tensor-parallel sizes that differ): SrcOff and DstOff are where the heads both
// hold start within a source and a destination block, Len their bytes. The zero Slice
// moves whole blocks between equal ranks.
type Slice struct{ SrcOff, DstOff, Len uint64 }

// HeadSlice is the slice between a source rank holding heads src and a destination rank
// holding dst, each head headBytes of a block (the HND layout: a block is its heads one
// after another): the zero Slice when they hold the same heads, an error when they share
// none.
func HeadSlice(src, dst agentv1.Heads, headBytes uint64) (Slice, error) {
	if src == dst {
		return Slice{}, nil
	}
	lo, hi := max(src.First, dst.First), min(src.End(), dst.End())
	if lo >= hi {
		return Slice{}, fmt.Errorf("writer: the source rank holds KV heads %s and the destination rank %s: they share none", src, dst)
	}
	return Slice{SrcOff: uint64(lo-src.First) * headBytes, DstOff: uint64(lo-dst.First) * headBytes, Len: uint64(hi-lo) * headBytes}, nil
}

// Plan maps a transfer onto the regions. Every block id is checked against both sides'
// regions before anything is planned, so an out-of-bounds request is refused whole,
// never half-written. Pairs are taken in source-block order, whatever order the prompt's
// positions gave them, and contiguous source and destination runs merge into one write
// per region, split where a write would exceed maxMsg bytes. Source and destination must
// hold the same regions with the same block length, or with a slice (sl) of each block
// moved: one write per block and region then, since a block's slice is contiguous but
// the next block's is not next to it on both sides.
func Plan(t rendezvous.Transfer, src, dst []Region, maxMsg uint64, sl Slice) ([]Write, error) {
	if len(t.Src) != len(t.Dst) {
		return nil, fmt.Errorf("writer: %d source blocks for %d destination blocks", len(t.Src), len(t.Dst))
	}
	dstByID := map[int]Region{}
	for _, r := range dst {
		dstByID[r.ID] = r
	}
	// Every region holds the same block ids, so one pass against the smallest region of
	// each side checks them all.
	srcBlocks, dstBlocks, smallest := ^uint32(0), ^uint32(0), 0
	for _, s := range src {
		d, ok := dstByID[s.ID]
		switch {
		case !ok:
			return nil, fmt.Errorf("writer: region %d does not match between source and destination", s.ID)
		case sl.Len == 0 && d.BlockLen != s.BlockLen:
			return nil, fmt.Errorf("writer: region %d does not match between source and destination (%d- and %d-byte blocks)", s.ID, s.BlockLen, d.BlockLen)
		case sl.Len != 0 && (sl.SrcOff+sl.Len > s.BlockLen || sl.DstOff+sl.Len > d.BlockLen):
			return nil, fmt.Errorf("writer: region %d's %d- and %d-byte blocks do not hold the heads' slice %+v", s.ID, s.BlockLen, d.BlockLen, sl)
		case s.BlockLen == 0 || s.BlockLen > maxMsg:
			return nil, fmt.Errorf("writer: region %d's %d-byte blocks do not fit the provider's %d-byte messages", s.ID, s.BlockLen, maxMsg)
		}
		if min(s.Blocks, d.Blocks) < min(srcBlocks, dstBlocks) {
			smallest = s.ID
		}
		srcBlocks, dstBlocks = min(srcBlocks, s.Blocks), min(dstBlocks, d.Blocks)
	}
	for i := range t.Src {
		if t.Src[i] >= srcBlocks || t.Dst[i] >= dstBlocks {
			return nil, fmt.Errorf("writer: block %d→%d is outside region %d (%d source, %d destination blocks)", t.Src[i], t.Dst[i],
				smallest, srcBlocks, dstBlocks)
		}
	}

	// Position order hides runs: an engine that freed a request's blocks tail first hands
	// them out again in descending order (a 16k-token pull on vLLM 0.26 planned 18,943
	// copies in position order where its push, in source order, planned 166).
	t.Src, t.Dst = bySource(t.Src, t.Dst)

	if sl.Len != 0 {
		writes := make([]Write, 0, len(src)*len(t.Src))
		for _, s := range src {
			d := dstByID[s.ID]
			for i := range t.Src {
				writes = append(writes, Write{Region: s.ID, SrcOff: uint64(t.Src[i])*s.BlockLen + sl.SrcOff,
					DstOff: uint64(t.Dst[i])*d.BlockLen + sl.DstOff, Len: sl.Len, Blocks: 1})
			}
		}
		return writes, nil
	}

	// Runs depend only on the block ids and how many blocks one write may carry, not on
	// the region: find them once per block length, then emit one write per run and region.
	type run struct {
		src, dst uint32
		n        int
	}
	runsFor := map[int][]run{}
	var writes []Write
	for _, s := range src {
		perWrite := int(maxMsg / s.BlockLen) // blocks one write may carry
		runs, ok := runsFor[perWrite]
		if !ok {
			for i := 0; i < len(t.Src); {
				j := i + 1
				for j < len(t.Src) && j-i < perWrite && t.Src[j] == t.Src[j-1]+1 && t.Dst[j] == t.Dst[j-1]+1 {
					j++
				}
				runs = append(runs, run{src: t.Src[i], dst: t.Dst[i], n: j - i})
				i = j
			}
			runsFor[perWrite] = runs
		}
		for _, r := range runs {
			writes = append(writes, Write{
				Region: s.ID,
				SrcOff: uint64(r.src) * s.BlockLen,
				DstOff: uint64(r.dst) * s.BlockLen,
				Len:    uint64(r.n) * s.BlockLen,
				Blocks: r.n,
			})
		}
	}
	return writes, nil
}

// bySource returns the pairs ordered by source block: copies when they are not already
// (the common case, a request's blocks allocated in order, costs no copy).
func bySource(src, dst []uint32) ([]uint32, []uint32) {
	if slices.IsSorted(src) {
		return src, dst
	}
	idx := make([]int, len(src))
	for i := range idx {
		idx[i] = i
	}
	slices.SortFunc(idx, func(a, b int) int { return cmp.Compare(src[a], src[b]) })
	s, d := make([]uint32, len(src)), make([]uint32, len(dst))
	for i, j := range idx {
		s[i], d[i] = src[j], dst[j]
	}
	return s, d
}
