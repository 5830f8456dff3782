package agentv1

import (
	"bytes"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"slices"
	"testing"
)

var update = flag.Bool("update", false, "rewrite testdata/sources.json from the current functions")

// The vLLM connector names rank pairs by the same rules (kvhandoff_vllm/heads.py); its test
// reads this table, which must be what these functions answer.
func TestSourcesTable(t *testing.T) {
	type row struct {
		KVHeads      uint32     `json:"kvHeads"`
		Prefill      uint32     `json:"prefill"`
		Decode       uint32     `json:"decode"`
		Sources      [][]uint32 `json:"sources"`
		Destinations [][]uint32 `json:"destinations"`
	}
	var table []row
	for _, kv := range []uint32{1, 2, 4, 6, 8, 16} {
		for _, p := range []uint32{1, 2, 3, 4, 8} {
			for _, d := range []uint32{1, 2, 3, 4, 8} {
				if CheckShards(kv, p) != nil || CheckShards(kv, d) != nil {
					continue
				}
				r := row{KVHeads: kv, Prefill: p, Decode: d}
				for j := range d {
					src, err := Sources(kv, p, d, j)
					if err != nil {
						t.Fatal(err)
					}
					r.Sources = append(r.Sources, src)
				}
				for i := range p {
					dst, err := Destinations(kv, p, d, i)
					if err != nil {
						t.Fatal(err)
					}
					r.Destinations = append(r.Destinations, append([]uint32{}, dst...)) // [] where it feeds none, not null
				}
				table = append(table, r)
			}
		}
	}
	got, err := json.MarshalIndent(table, "", " ")
	if err != nil {
		t.Fatal(err)
	}
	got = append(got, '\n')
	if *update {
		if err := os.WriteFile("testdata/sources.json", got, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	want, err := os.ReadFile("testdata/sources.json")
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		t.Errorf("testdata/sources.json is not what Sources and Destinations answer; go test -run TestSourcesTable -update rewrites it")
	}
}

// Every decode rank gets each of its heads from exactly one prefill rank that holds it,
// and Destinations is Sources seen from the other side.
func TestEveryDecodeHeadHasOneSource(t *testing.T) {
	for _, c := range []struct{ heads, p, d uint32 }{
		{8, 1, 2}, {8, 1, 4}, {8, 2, 1}, {8, 4, 1}, {8, 2, 4}, {8, 4, 2}, {8, 8, 2}, {8, 8, 8}, {6, 2, 3},
		{2, 4, 2}, {1, 8, 2}, {2, 8, 4}, {4, 2, 8},
	} {
		t.Run(fmt.Sprintf("%d heads %d→%d", c.heads, c.p, c.d), func(t *testing.T) {
			fed := map[uint32][]uint32{}
			for j := range c.d {
				src, err := Sources(c.heads, c.p, c.d, j)
				if err != nil {
					t.Fatal(err)
				}
				want := RankHeads(c.heads, c.d, j)
				covered := map[uint32]int{}
				for _, i := range src {
					fed[i] = append(fed[i], j)
					h := RankHeads(c.heads, c.p, i)
					for x := max(h.First, want.First); x < min(h.End(), want.End()); x++ {
						covered[x]++
					}
				}
				for x := want.First; x < want.End(); x++ {
					if covered[x] != 1 {
						t.Errorf("decode rank %d: head %d comes from %d sources %v", j, x, covered[x], src)
					}
				}
				if c.p == c.d && c.heads >= c.p && !slices.Equal(src, []uint32{j}) {
					t.Errorf("equal sizes: decode rank %d pairs with %v, not itself", j, src)
				}
			}
			for i := range c.p {
				dst, err := Destinations(c.heads, c.p, c.d, i)
				if err != nil {
					t.Fatal(err)
				}
				if !slices.Equal(dst, fed[i]) {
					t.Errorf("prefill rank %d feeds %v, Sources say %v", i, dst, fed[i])
				}
			}
		})
	}
}

func TestShardsThatCannotBeMappedAreRefused(t *testing.T) {
	for _, c := range []struct{ heads, size uint32 }{{6, 4}, {8, 3}, {0, 2}, {8, 0}} {
		if err := CheckShards(c.heads, c.size); err == nil {
			t.Errorf("%d heads over %d: accepted", c.heads, c.size)
		}
	}
	if _, err := Sources(6, 4, 2, 0); err == nil {
		t.Error("Sources accepted 6 heads over TP 4")
	}
}

func TestPairRequestIDs(t *testing.T) {
	if got := PairRequestID("r", 1, 1, 2, 2); got != "r" {
		t.Errorf("equal sizes: %q", got)
	}
	if got := PairRequestID("r", 0, 3, 1, 4); got != "r#0>3" {
		t.Errorf("1→4: %q", got)
	}
}
