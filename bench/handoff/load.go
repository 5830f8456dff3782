package handoff

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvhandoff/kvhandoff/test/simengine"
)

// engineLoad is the simulated engines' own CPU work, without the engines: at the run's
// arrival rate, every rank produces one request's KV and checks it (Fill, then Verify) —
// what the prefill engines and the decode engines do per request in the benchmark. On
// GPUs that work is not the CPU's; here it competes with the transfers, and measuring the
// floor under it shows how much of the gap it accounts for.
type engineLoad struct {
	caches []*simengine.Cache
	blocks []uint32
}

func newEngineLoad(l simengine.Layout, tp, blocksPerRequest int) (*engineLoad, error) {
	l.Blocks = blocksPerRequest
	el := &engineLoad{blocks: make([]uint32, blocksPerRequest)}
	for i := range el.blocks {
		el.blocks[i] = uint32(i)
	}
	for range tp {
		regions := make([][]byte, l.Regions())
		for r := range regions {
			regions[r] = make([]byte, l.Blocks*l.BlockBytes())
		}
		c, err := simengine.NewCache(l, regions)
		if err != nil {
			return nil, err
		}
		el.caches = append(el.caches, c)
	}
	return el, nil
}

// run does one request's work on every rank per Poisson arrival at qps until ctx ends.
func (el *engineLoad) run(ctx context.Context, qps float64, seed uint64) error {
	rng := rand.New(rand.NewPCG(seed, 1))
	var wg sync.WaitGroup
	defer wg.Wait()
	for i := 0; ; i++ {
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(time.Duration(rng.ExpFloat64() / qps * float64(time.Second))):
		}
		req := fmt.Sprintf("load-%d", i)
		for _, c := range el.caches {
			wg.Add(1)
			go func() {
				defer wg.Done()
				c.Fill(req, el.blocks)
				_ = c.Verify(req, el.blocks)
			}()
		}
	}
}

// floorUnderLoad measures the TP-pairs wire floor while the engines' CPU work runs.
func floorUnderLoad(sc Scenario, l simengine.Layout, blocksPerRequest int, bytes int, cpus *unix.CPUSet) (time.Duration, error) {
	el, err := newEngineLoad(l, sc.TP, blocksPerRequest)
	if err != nil {
		return 0, err
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- el.run(ctx, sc.QPS, sc.Seed) }()
	d, err := wireFloorParallel(sc.Provider, sc.Rails, bytes, sc.TP, l.Regions(), cpus)
	cancel()
	if lerr := <-done; err == nil {
		err = lerr
	}
	return d, err
}
