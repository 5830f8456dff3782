package agentv1

import (
	"fmt"
	"strconv"
)

// A prefill engine and a decode engine of different tensor-parallel sizes exchange KV
// rank pair by rank pair: each decode rank takes every KV head it holds from a prefill
// rank that holds it. Each pair is a transfer of its own on the agents, named by
// PairRequestID, so that registrations, pulls, leases, cancels and events keep their
// one-source-one-destination meaning; an engine's request is delivered when every pair of
// every decode rank is (vLLM finishes a receive only once all its ranks have). The agents
// move each pair's shared heads, a slice of every block: this needs the HND layout
// (a block is its heads one after another), which the manager sets for such pools.

// Heads is a contiguous range of a model's KV heads: [First, First+Count).
type Heads struct{ First, Count uint32 }

// End is the head after the range's last.
func (h Heads) End() uint32 { return h.First + h.Count }

// Shared is how many heads h and o both hold.
func (h Heads) Shared(o Heads) uint32 {
	lo, hi := max(h.First, o.First), min(h.End(), o.End())
	return max(hi, lo) - lo
}

func (h Heads) String() string { return fmt.Sprintf("[%d,%d)", h.First, h.End()) }

// CheckShards reports whether kvHeads split over a tensor-parallel size: evenly, or with
// fewer heads than ranks each head replicated on size/kvHeads ranks (vLLM's layout; MLA's
// latent counts as one head).
func CheckShards(kvHeads, size uint32) error {
	if kvHeads == 0 || size == 0 || (kvHeads%size != 0 && size%kvHeads != 0) {
		return fmt.Errorf("%d KV heads neither split over nor replicate across tensor-parallel size %d", kvHeads, size)
	}
	return nil
}

// RankHeads is the heads that rank of a tensor-parallel size holds; CheckShards must pass.
func RankHeads(kvHeads, size, rank uint32) Heads {
	if kvHeads >= size {
		n := kvHeads / size
		return Heads{First: rank * n, Count: n}
	}
	return Heads{First: rank / (size / kvHeads), Count: 1}
}

// Sources is the prefill ranks (of p) that decode rank (of d) takes its heads from, in
// ascending order, each named once. A head replicated on several prefill ranks is read from
// one of them, chosen by the decode rank so that decode ranks spread over the replicas.
func Sources(kvHeads, p, d, decodeRank uint32) ([]uint32, error) {
	if err := CheckShards(kvHeads, p); err != nil {
		return nil, err
	}
	if err := CheckShards(kvHeads, d); err != nil {
		return nil, err
	}
	want := RankHeads(kvHeads, d, decodeRank)
	var out []uint32
	for h := want.First; h < want.End(); h++ {
		var holders []uint32
		for i := range p {
			if r := RankHeads(kvHeads, p, i); r.First <= h && h < r.End() {
				holders = append(holders, i)
			}
		}
		if i := holders[decodeRank%uint32(len(holders))]; len(out) == 0 || out[len(out)-1] != i {
			out = append(out, i)
		}
	}
	return out, nil
}

// Destinations is the decode ranks (of d) that prefill rank (of p) feeds, ascending.
func Destinations(kvHeads, p, d, prefillRank uint32) ([]uint32, error) {
	var out []uint32
	for j := range d {
		src, err := Sources(kvHeads, p, d, j)
		if err != nil {
			return nil, err
		}
		for _, i := range src {
			if i == prefillRank {
				out = append(out, j)
			}
		}
	}
	return out, nil
}

// PairRequestID names one rank pair's transfer of a request: the request id itself when
// both engines have the same tensor-parallel size (each rank pairs with its own number),
// else the request id, '#', the prefill rank, '>', the decode rank ("req-7#0>1").
func PairRequestID(request string, prefillRank, decodeRank, p, d uint32) string {
	if p == d {
		return request
	}
	return request + "#" + strconv.FormatUint(uint64(prefillRank), 10) + ">" + strconv.FormatUint(uint64(decodeRank), 10)
}
