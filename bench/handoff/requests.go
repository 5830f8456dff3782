package handoff

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	agentv1 "github.com/kvhandoff/kvhandoff/transferagent/api/v1"
)

// prefillServer is the prefill engine: requests queue for it, one at a time, as on a
// real engine at steady load. It allocates each request's blocks on every rank, produces
// the KV (the simulated engine's pattern) within the modelled prefill time, and reports
// the blocks ready; it frees them when the agent says they were transferred.
type prefillServer struct {
	rk     *ranks
	d      time.Duration
	blocks int
	jobs   chan *prefillJob
	done   chan struct{}
}

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

func newPrefillServer(rk *ranks, d time.Duration, blocks int) *prefillServer {
	s := &prefillServer{rk: rk, d: d, blocks: blocks, jobs: make(chan *prefillJob, 1024), done: make(chan struct{})}
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
		err := parallel(len(s.rk.P), func(r int) error {
			b, err := s.rk.P[r].AllocateWait(ctx, s.blocks)
			if err != nil {
				return err
			}
			src[r] = b
			s.rk.P[r].Cache.Fill(j.req, b)
			return nil
		})
		time.Sleep(time.Until(start.Add(s.d))) // the rest of the modelled compute
		end := time.Now()
		if err != nil {
			j.result <- prefillResult{end: end, err: err}
			continue
		}
		// The engine reports the blocks from its connector's thread and goes on with the
		// next prefill: the calls return at once, but on a 2-core machine the transfers
		// they start compete for the CPU, and the engine loop must not queue behind them.
		go func() {
			err := parallel(len(s.rk.P), func(r int) error { return s.rk.P[r].SourceReady(ctx, j.req, 0, src[r], true) })
			j.result <- prefillResult{end: end, src: src, err: err}
			if err != nil {
				return
			}
			var mu sync.Mutex
			var total uint64
			_ = parallel(len(s.rk.P), func(r int) error {
				wctx, cancel := context.WithTimeout(ctx, time.Minute)
				defer cancel()
				ev, err := s.rk.P[r].Wait(wctx, j.req, 1)
				if err == nil {
					mu.Lock()
					total += ev.Descriptors
					mu.Unlock()
				}
				s.rk.P[r].Free(src[r])
				return err
			})
			j.descriptors <- total
		}()
	}
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

// allocate takes a request's blocks on every decode rank, in rank order: requests that
// each hold some ranks' blocks and wait for others' would deadlock a full cache.
func allocate(ctx context.Context, rk *ranks, blocks int) ([][]uint32, error) {
	dst := make([][]uint32, len(rk.D))
	for r, d := range rk.D {
		b, err := d.AllocateWait(ctx, blocks)
		if err != nil {
			for i := range r {
				rk.D[i].Free(dst[i])
			}
			return nil, err
		}
		dst[r] = b
	}
	return dst, nil
}

// awaitDelivered waits for every decode rank's DELIVERED and returns when the last came.
func awaitDelivered(ctx context.Context, rk *ranks, req string) (time.Time, uint64, error) {
	var mu sync.Mutex
	var last time.Time
	var desc uint64
	err := parallel(len(rk.D), func(r int) error {
		wctx, cancel := context.WithTimeout(ctx, time.Minute)
		defer cancel()
		ev, err := rk.D[r].Wait(wctx, req, 1)
		now := time.Now()
		if err != nil {
			return err
		}
		if ev.Type != agentv1.Event_DELIVERED {
			return fmt.Errorf("rank %d: %s: %s", r, ev.Type, ev.Reason)
		}
		mu.Lock()
		if now.After(last) {
			last = now
		}
		desc += ev.Descriptors
		mu.Unlock()
		return nil
	})
	return last, desc, err
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
func pushRequest(ctx context.Context, rk *ranks, pf *prefillServer, req string, arrival time.Time, blocks int) outcome {
	job := pf.submit(req)
	dst, err := allocate(ctx, rk, blocks)
	if err != nil {
		return outcome{err: err}
	}
	err = parallel(len(rk.D), func(r int) error { return rk.D[r].RegisterDestination(ctx, req, 1, dst[r], rk.P[r].Self) })
	if err != nil {
		return outcome{err: err}
	}
	res := <-job.result
	if res.err != nil {
		return outcome{err: res.err}
	}
	ready, _, err := awaitDelivered(ctx, rk, req)
	if err != nil {
		return outcome{err: err}
	}
	if err := verifyAndFree(rk, req, dst); err != nil {
		return outcome{err: err}
	}
	return outcome{ttft: ready.Sub(arrival), handoff: ready.Sub(res.end), descriptors: <-job.descriptors}
}

// pullRequest: after prefill the router relays the source block ids; only then does
// decode allocate, and its agent acquires the blocks and reads them.
func pullRequest(ctx context.Context, rk *ranks, pf *prefillServer, req string, arrival time.Time, blocks int) outcome {
	job := pf.submit(req)
	res := <-job.result
	if res.err != nil {
		return outcome{err: res.err}
	}
	dst, err := allocate(ctx, rk, blocks)
	if err != nil {
		return outcome{err: err}
	}
	err = parallel(len(rk.D), func(r int) error { return rk.D[r].Pull(ctx, req, 1, rk.P[r].Self, res.src[r], dst[r]) })
	if err != nil {
		return outcome{err: err}
	}
	ready, desc, err := awaitDelivered(ctx, rk, req)
	if err != nil {
		return outcome{err: err}
	}
	if err := verifyAndFree(rk, req, dst); err != nil {
		return outcome{err: err}
	}
	<-job.descriptors
	return outcome{ttft: ready.Sub(arrival), handoff: ready.Sub(res.end), descriptors: desc}
}
