package handoff

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	agentv1 "github.com/kvhandoff/kvhandoff/transferagent/api/v1"
)

// prefillServer is the prefill engine: requests queue for it, one at a time, as on a
// real engine at steady load. It allocates each request's blocks on every rank, produces
// the KV (the simulated engine's pattern) within the modelled prefill time, and reports
// the blocks ready — at its end, or layer group by layer group as the modelled layers
// finish (layer-streamed push); it frees them when the agent says they were transferred.
type prefillServer struct {
	rk     *ranks
	d      time.Duration
	blocks int
	// groups is how many layer groups a request is reported in; 1: whole, at prefill end.
	groups int
	jobs   chan *prefillJob
	done   chan struct{}
	// leaked counts ranks' blocks held back because their agent never answered.
	leaked atomic.Int64
}

// waitLimit bounds every wait of the benchmark (free blocks, an agent's answer): under
// overload requests fail and are counted, they never hang the run. It is above the
// decode agent's own deadline for an outcome that never came (by default the 60 s
// registration timeout, then a quarantine of the 30 s lease and a second: 91.2 s), after
// which an agent answers on its own; a wait that runs out means an agent broke that rule.
const waitLimit = 150 * time.Second

type prefillJob struct {
	req    string
	result chan prefillResult
	// descriptors receives the writes the prefill agent posted (push), once freed.
	descriptors chan uint64
}

type prefillResult struct {
	end time.Time
	src [][]uint32
	err error
}

func newPrefillServer(rk *ranks, d time.Duration, blocks, groups int) *prefillServer {
	s := &prefillServer{rk: rk, d: d, blocks: blocks, groups: max(groups, 1), jobs: make(chan *prefillJob, 1024), done: make(chan struct{})}
	go s.run()
	return s
}

func (s *prefillServer) stop() { close(s.jobs); <-s.done }

func (s *prefillServer) submit(req string) *prefillJob {
	j := &prefillJob{req: req, result: make(chan prefillResult, 1), descriptors: make(chan uint64, 1)}
	s.jobs <- j
	return j
}

func (s *prefillServer) run() {
	defer close(s.done)
	ctx := context.Background()
	for j := range s.jobs {
		start := time.Now()
		src := make([][]uint32, len(s.rk.P))
		actx, cancel := context.WithTimeout(ctx, waitLimit)
		err := parallel(len(s.rk.P), func(r int) error {
			b, err := s.rk.P[r].AllocateWait(actx, s.blocks)
			if err != nil {
				return fmt.Errorf("prefill rank %d: no free blocks within %s: %w", r, waitLimit, err)
			}
			src[r] = b
			s.rk.P[r].Cache.Fill(j.req, b)
			return nil
		})
		cancel()
		if err != nil {
			time.Sleep(time.Until(start.Add(s.d))) // the rest of the modelled compute
			for r, b := range src {
				if b != nil {
					s.rk.P[r].Free(b) // never reported ready: no agent knows them
				}
			}
			j.result <- prefillResult{end: time.Now(), err: err}
			j.descriptors <- 0
			continue
		}
		// The engine reports the blocks from its connector's thread and goes on with the
		// next prefill at the modelled end: the calls return at once, but on a 2-core
		// machine the transfers they start compete for the CPU, and the engine loop must
		// not queue behind them.
		go func() {
			ready, end, err := s.report(ctx, j.req, src, start)
			j.result <- prefillResult{end: end, src: src, err: err}
			// Each rank's blocks go back only when its agent is done with them (SOURCE_DONE,
			// or FAILED once its lease or TTL ran out), as on a real engine; a rank whose
			// report was refused was never known to the agent.
			var mu sync.Mutex
			var total uint64
			_ = parallel(len(s.rk.P), func(r int) error {
				if !ready[r] {
					s.rk.P[r].Free(src[r])
					return nil
				}
				wctx, cancel := context.WithTimeout(ctx, waitLimit)
				defer cancel()
				ev, err := s.rk.P[r].Wait(wctx, j.req, 1)
				if err != nil {
					// The agent never answered: its writes or reads may still use the
					// blocks, so they stay out of the pool (counted as leaked).
					s.leaked.Add(1)
					return err
				}
				mu.Lock()
				total += ev.Descriptors
				mu.Unlock()
				s.rk.P[r].Free(src[r])
				return nil
			})
			j.descriptors <- total
		}()
		time.Sleep(time.Until(start.Add(s.d))) // the rest of the modelled compute
	}
}

// report reports a request's blocks ready on every rank: whole at the end of the
// modelled prefill, or in layer groups, group g once its layers' share of the prefill
// time has passed. It returns which ranks' agents accepted a part (they will answer for
// the request), when prefill ended, and why a report was refused. A rank that refused a
// group is told no later one.
func (s *prefillServer) report(ctx context.Context, req string, src [][]uint32, start time.Time) ([]bool, time.Time, error) {
	ready := make([]bool, len(s.rk.P))
	refused := make([]bool, len(s.rk.P))
	regions := s.rk.P[0].Cache.Layout.Regions()
	var errs error
	var end time.Time
	for g := range s.groups {
		time.Sleep(time.Until(start.Add(s.d * time.Duration(g+1) / time.Duration(s.groups))))
		end = time.Now()
		lo, hi := g*regions/s.groups, (g+1)*regions/s.groups
		final := g == s.groups-1
		errs = errors.Join(errs, parallel(len(s.rk.P), func(r int) error {
			if refused[r] {
				return nil
			}
			var err error
			if s.groups == 1 {
				err = s.rk.P[r].SourceReady(ctx, req, 0, src[r], final)
			} else {
				err = s.rk.P[r].SourceRegionsReady(ctx, req, uint32(lo), uint32(hi-lo), src[r], final)
			}
			ready[r] = ready[r] || err == nil
			refused[r] = err != nil
			return err
		}))
	}
	return ready, end, errs
}

// parallel runs fn for 0..n-1 concurrently and returns the first error.
func parallel(n int, fn func(int) error) error {
	var wg sync.WaitGroup
	var mu sync.Mutex
	var first error
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := fn(i); err != nil {
				mu.Lock()
				first = errors.Join(first, err)
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	return first
}

// turn orders the decode engine's admissions by arrival, as vLLM's scheduler admits
// waiting requests in order: a request allocates once the one before it has. Without it
// a later arrival could take the blocks an earlier one waits for while the prefill
// engine, which serves in arrival order, holds its own blocks for that earlier one — a
// cycle only the agents' timeouts broke, one expiry at a time.
type turn struct {
	prev <-chan struct{}
	mine chan struct{}
}

// first is the turn of a request with nobody before it.
func first() turn {
	prev := make(chan struct{})
	close(prev)
	return turn{prev: prev, mine: make(chan struct{})}
}

// next is the turn after t.
func (t turn) next() turn { return turn{prev: t.mine, mine: make(chan struct{})} }

// allocate takes a request's blocks on every decode rank in its turn, and in rank order:
// requests that each hold some ranks' blocks and wait for others' would deadlock a full
// cache.
func allocate(ctx context.Context, rk *ranks, blocks int, t turn) ([][]uint32, error) {
	ctx, cancel := context.WithTimeout(ctx, waitLimit)
	defer cancel()
	defer close(t.mine)
	select {
	case <-t.prev:
	case <-ctx.Done():
		return nil, fmt.Errorf("waiting for the requests before it to be admitted: %w", ctx.Err())
	}
	dst := make([][]uint32, len(rk.D))
	for r, d := range rk.D {
		b, err := d.AllocateWait(ctx, blocks)
		if err != nil {
			for i := range r {
				rk.D[i].Free(dst[i])
			}
			return nil, fmt.Errorf("decode rank %d: no free blocks within %s: %w", r, waitLimit, err)
		}
		dst[r] = b
	}
	return dst, nil
}

// settle waits for every decode rank's outcome of a request, as a real engine must before
// it reuses the blocks: a rank whose agent says nothing more will land (CANCEL_ACKED,
// FAILED) is freed here; a DELIVERED rank is left to the caller (verify, then free).
// cancel first asks the agents to stop (the request failed elsewhere); known marks the
// ranks whose agent knows the request, the others are freed at once. Blocks whose agent
// never answers stay out of the pool, counted in leaked. It returns which ranks were
// delivered, when the first and the last one were, their descriptors and why the request
// failed.
func settle(ctx context.Context, rk *ranks, req string, dst [][]uint32, known []bool, cancel bool,
	leaked *atomic.Int64) (delivered []bool, first, last time.Time, desc uint64, err error) {
	var mu sync.Mutex
	delivered = make([]bool, len(rk.D))
	err = parallel(len(rk.D), func(r int) error {
		if !known[r] {
			rk.D[r].Free(dst[r])
			return nil
		}
		if cancel {
			_ = rk.D[r].Cancel(ctx, req, 1) // NotFound: its outcome is already on its way
		}
		wctx, stop := context.WithTimeout(ctx, waitLimit)
		defer stop()
		ev, err := rk.D[r].Wait(wctx, req, 1)
		now := time.Now()
		if err != nil {
			leaked.Add(1)
			return fmt.Errorf("rank %d: no outcome within %s: %w", r, waitLimit, err)
		}
		if ev.Type != agentv1.Event_DELIVERED {
			rk.D[r].Free(dst[r])
			return fmt.Errorf("rank %d: %s: %s", r, ev.Type, ev.Reason)
		}
		mu.Lock()
		delivered[r] = true
		if now.After(last) {
			last = now
		}
		if first.IsZero() || now.Before(first) {
			first = now
		}
		desc += ev.Descriptors
		mu.Unlock()
		return nil
	})
	return delivered, first, last, desc, err
}

// complete verifies and frees a delivered request; after a failure it frees the ranks
// that were delivered (settle freed the others).
func complete(rk *ranks, req string, dst [][]uint32, delivered []bool, failed error) error {
	if failed != nil {
		for r, ok := range delivered {
			if ok {
				rk.D[r].Free(dst[r])
			}
		}
		return failed
	}
	return verifyAndFree(rk, req, dst)
}

// verifyAndFree checks every byte each decode rank received, then frees its blocks.
func verifyAndFree(rk *ranks, req string, dst [][]uint32) error {
	return parallel(len(rk.D), func(r int) error {
		defer rk.D[r].Free(dst[r])
		return rk.D[r].Cache.Verify(req, dst[r])
	})
}

// pushRequest: the router sends the request to prefill and picks its decode engine at
// once; decode registers its blocks while the request waits for and runs prefill, and at
// prefill end the prefill agent writes straight in.
func pushRequest(ctx context.Context, rk *ranks, pf *prefillServer, req string, arrival time.Time, blocks int, t turn) outcome {
	job := pf.submit(req)
	dst, err := allocate(ctx, rk, blocks, t)
	if err != nil {
		<-job.result
		<-job.descriptors // the source expires unclaimed and the prefill engine frees it
		return outcome{err: err}
	}
	known := make([]bool, len(rk.D))
	err = parallel(len(rk.D), func(r int) error {
		err := rk.D[r].RegisterDestination(ctx, req, 1, dst[r], rk.P[r].Self)
		known[r] = err == nil
		return err
	})
	res := <-job.result
	if err == nil {
		err = res.err
	}
	delivered, firstRank, ready, _, serr := settle(ctx, rk, req, dst, known, err != nil, &pf.leaked)
	if err == nil {
		err = serr
	}
	descriptors := <-job.descriptors
	if err := complete(rk, req, dst, delivered, err); err != nil {
		return outcome{err: err}
	}
	return outcome{ttft: ready.Sub(arrival), from: res.end, firstRank: firstRank, to: ready, descriptors: descriptors}
}

// pullRequest: after prefill the router relays the source block ids; only then does
// decode allocate, and its agent acquires the blocks and reads them.
func pullRequest(ctx context.Context, rk *ranks, pf *prefillServer, req string, arrival time.Time, blocks int, t turn) outcome {
	job := pf.submit(req)
	res := <-job.result
	if res.err != nil {
		close(t.mine)
		return outcome{err: res.err}
	}
	dst, err := allocate(ctx, rk, blocks, t)
	if err != nil {
		return outcome{err: err}
	}
	known := make([]bool, len(rk.D))
	err = parallel(len(rk.D), func(r int) error {
		err := rk.D[r].Pull(ctx, req, 1, rk.P[r].Self, res.src[r], dst[r])
		known[r] = err == nil
		return err
	})
	delivered, firstRank, ready, desc, serr := settle(ctx, rk, req, dst, known, err != nil, &pf.leaked)
	if err == nil {
		err = serr
	}
	<-job.descriptors
	if err := complete(rk, req, dst, delivered, err); err != nil {
		return outcome{err: err}
	}
	return outcome{ttft: ready.Sub(arrival), from: res.end, firstRank: firstRank, to: ready, descriptors: desc}
}
