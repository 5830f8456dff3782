package topology_test

import (
	"fmt"
	"math/rand/v2"
	"path/filepath"
	"slices"
	"testing"

	"github.com/kvhandoff/kvhandoff/internal/deviceplugin/inventory"
	"github.com/kvhandoff/kvhandoff/internal/deviceplugin/sysfs/sysfstest"
	. "github.com/kvhandoff/kvhandoff/internal/deviceplugin/topology"
)

// nics builds switches × perSwitch NICs, switches split over two NUMA nodes.
func nics(switches, perSwitch int) []Device {
	var out []Device
	for s := range switches {
		for n := range perSwitch {
			out = append(out, Device{
				ID:      fmt.Sprintf("efa%02d", s*perSwitch+n),
				Bridges: []string{fmt.Sprintf("root%d", s), fmt.Sprintf("switch%d", s), fmt.Sprintf("port%d.%d", s, n)},
				NUMA:    s * 2 / switches,
			})
		}
	}
	return out
}

func cost(ds []Device, ids []string) (int, int) {
	sw, numa := map[string]bool{}, map[int]bool{}
	for _, d := range ds {
		if slices.Contains(ids, d.ID) {
			sw[d.Switch()] = true
			numa[d.NUMA] = true
		}
	}
	return len(sw), len(numa)
}

// bruteForce returns the best (switches, NUMA nodes) over every choice of size devices
// that holds mustInclude.
func bruteForce(ds []Device, must []string, size int) (int, int) {
	bestS, bestN := 1<<30, 1<<30
	var rec func(i int, chosen []string)
	rec = func(i int, chosen []string) {
		if len(chosen) == size {
			for _, m := range must {
				if !slices.Contains(chosen, m) {
					return
				}
			}
			s, n := cost(ds, chosen)
			if s < bestS || (s == bestS && n < bestN) {
				bestS, bestN = s, n
			}
			return
		}
		if i == len(ds) || len(ds)-i < size-len(chosen) {
			return
		}
		rec(i+1, append(slices.Clone(chosen), ds[i].ID))
		rec(i+1, chosen)
	}
	rec(0, nil)
	return bestS, bestN
}

// fixtureNICs discovers a fixture's EFAs as locality sees them.
func fixtureNICs(t *testing.T, f sysfstest.Fixture) []Device {
	dir := t.TempDir()
	if err := f.Write(dir, filepath.Join(dir, "dev")); err != nil {
		t.Fatal(err)
	}
	var out []Device
	for _, d := range inventory.Discover(inventory.Options{Root: dir, DevRoot: filepath.Join(dir, "dev")}).OfKind(inventory.EFA) {
		out = append(out, Device{ID: d.ID, Bridges: d.Bridges, NUMA: d.NUMANode})
	}
	return out
}

func TestPreferredIsOptimalAgainstBruteForce(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	machines := map[string][]Device{
		"p5en fixture": fixtureNICs(t, sysfstest.P5en()),
		"p5 fixture":   fixtureNICs(t, sysfstest.P5()),
		"trn2 fixture": fixtureNICs(t, sysfstest.Trn2()),
		"trn1 fixture": fixtureNICs(t, sysfstest.Trn1()),
		"8x2":          nics(8, 2),
		"16x1":         nics(16, 1),
	}
	for shape, all := range machines {
		for trial := range 40 {
			// A random availability, as after other pods took some NICs.
			var avail []Device
			for _, d := range all {
				if rng.IntN(4) != 0 {
					avail = append(avail, d)
				}
			}
			if len(avail) < 2 {
				continue
			}
			size := 1 + rng.IntN(min(6, len(avail)))
			var must []string
			if rng.IntN(2) == 0 {
				must = []string{avail[rng.IntN(len(avail))].ID}
			}
			got := Preferred(avail, must, size)
			if len(got) != size {
				t.Fatalf("%s trial %d: got %d devices, want %d", shape, trial, len(got), size)
			}
			for _, m := range must {
				if !slices.Contains(got, m) {
					t.Fatalf("%s trial %d: must-include %s missing from %v", shape, trial, m, got)
				}
			}
			gs, gn := cost(avail, got)
			bs, bn := bruteForce(avail, must, size)
			if gs != bs || gn != bn {
				t.Fatalf("%s trial %d: %v uses %d switches / %d NUMA nodes, brute force %d / %d", shape, trial, got, gs, gn, bs, bn)
			}
		}
	}
}

func TestPreferredRefusesWhatCannotBeMet(t *testing.T) {
	all := nics(2, 2)
	if Preferred(all, nil, 5) != nil || Preferred(all, []string{"nope"}, 1) != nil {
		t.Error("an impossible request got an answer")
	}
}

func TestAssignFallsBackToNUMAWithoutSwitches(t *testing.T) {
	accs := []Device{{ID: "gpu0", NUMA: 0}, {ID: "gpu1", NUMA: 1}}
	ns := []Device{{ID: "efa0", NUMA: 1}, {ID: "efa1", NUMA: 0}}
	got := Assign(accs, ns)
	if !slices.Equal(got["gpu0"].NICs, []string{"efa1"}) || got["gpu0"].Locality != LocalityNUMA {
		t.Errorf("gpu0 got %+v", got["gpu0"])
	}
	unknown := Assign([]Device{{ID: "a", NUMA: -1}}, []Device{{ID: "n", NUMA: -1}})
	if unknown["a"].Locality != LocalityNone {
		t.Errorf("locality without switches or NUMA = %s", unknown["a"].Locality)
	}
}
