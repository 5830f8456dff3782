// Package handoff is the push-versus-pull handoff benchmark (make bench-handoff): two
// transfer agents as processes on loopback, one simulated prefill and one simulated
// decode engine per TP rank, Poisson arrivals, every byte verified. It reports TTFT and
// the handoff overhead (prefill end → decode ready) against the wire floor, a plain
// libfabric write of the same bytes on the same provider, measured in the same run.
package handoff

import (
	"errors"
	"fmt"
	"runtime"
	"slices"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvhandoff/kvhandoff/internal/transferagent/fabric"
)

// wirePair is two endpoints of the provider in this process, the floor's measuring rig.
type wirePair struct {
	src, dst       *fabric.Endpoint
	from, to       fabric.Memory
	srcReg, dstReg *fabric.Region
	peer           fabric.Peer
	buf            []fabric.Completion
	// cpus binds both sides' threads, as the agents are bound (nil: anywhere).
	cpus *unix.CPUSet
}

func newWirePair(provider string, rails, size int, cpus *unix.CPUSet) (*wirePair, error) {
	w := &wirePair{buf: make([]fabric.Completion, 16), cpus: cpus}
	var err error
	if w.src, err = fabric.OpenRails(provider, rails); err != nil {
		return nil, err
	}
	if w.dst, err = fabric.OpenRails(provider, rails); err != nil {
		return nil, err
	}
	if w.from, err = fabric.Alloc(size); err != nil {
		return nil, err
	}
	if w.to, err = fabric.Alloc(size); err != nil {
		return nil, err
	}
	for i := range w.from {
		w.from[i] = byte(i * 7)
	}
	if w.srcReg, err = w.src.Register(w.from, fabric.Source); err != nil {
		return nil, err
	}
	if w.dstReg, err = w.dst.Register(w.to, fabric.Target); err != nil {
		return nil, err
	}
	addrs, err := w.dst.Addresses()
	if err != nil {
		return nil, err
	}
	w.peer, err = w.src.AddPeer(addrs...)
	return w, err
}

func (w *wirePair) close() {
	w.src.Quiesce()
	w.dst.Quiesce()
	w.srcReg.Close()
	w.dstReg.Close()
	w.src.Close()
	w.dst.Close()
	w.from.Free()
	w.to.Free()
}

// write moves n bytes in writes of at most chunk bytes, at most window of them in
// flight, then a CQ-data signal, and
// returns the time from the first post until the signal arrived at the target: what a
// handoff of n bytes costs when nothing but the wire is in the way. Each side is driven
// by its own goroutine, as each agent drives its own endpoint: one thread polling both
// would do the sender's and the receiver's copies in turn, and the floor would be slower
// than the agents it bounds.
func (w *wirePair) write(n, chunk, window int) (d time.Duration, err error) {
	pinned(w.cpus, func() { d, err = w.writePinned(n, chunk, window) })
	return d, err
}

func (w *wirePair) writePinned(n, chunk, window int) (time.Duration, error) {
	start := time.Now()
	arrived := make(chan error, 1)
	stop := make(chan struct{})
	defer close(stop)
	go pinned(w.cpus, func() {
		buf := make([]fabric.Completion, 16)
		for {
			select {
			case <-stop:
				return
			default:
			}
			for _, c := range buf[:wait(w.dst, buf)] {
				if c.Err != nil || c.Remote {
					arrived <- c.Err
					return
				}
			}
		}
	})
	posted, done := 0, 0
	pending := 0
	for off := 0; off < n; {
		l := min(chunk, n-off)
		var err error
		if pending < window {
			err = w.src.Write(w.peer, w.srcReg, uint64(off), uint64(l), w.dstReg.RemoteAddr(uint64(off)), w.dstReg.Keys, uint64(posted+1))
		}
		if pending >= window || errors.Is(err, fabric.ErrAgain) {
			d, err := w.reap()
			if err != nil {
				return 0, err
			}
			done += d
			pending -= d
			continue
		}
		if err != nil {
			return 0, err
		}
		posted++
		pending++
		off += l
	}
	for done < posted {
		d, err := w.reap()
		if err != nil {
			return 0, err
		}
		done += d
	}
	for {
		err := w.src.WriteData(w.peer, 1, w.dstReg.RemoteAddr(0), w.dstReg.Keys, 1<<40)
		if err == nil {
			break
		}
		if !errors.Is(err, fabric.ErrAgain) {
			return 0, err
		}
		if _, err := w.reap(); err != nil {
			return 0, err
		}
	}
	for {
		select {
		case err := <-arrived:
			return time.Since(start), err
		default:
			wait(w.src, w.buf) // the signal's own completion
		}
	}
}

// wait reads completions as the agents do: asleep in the provider, which moves data while
// it waits, where the provider allows; else polling, leaving the core to others between
// polls (on few cores the pairs with work need it).
func wait(ep *fabric.Endpoint, buf []fabric.Completion) int {
	if ep.Waitable() {
		return ep.Wait(buf, time.Millisecond)
	}
	n := ep.Poll(buf)
	if n == 0 {
		runtime.Gosched()
	}
	return n
}

// reap waits for write completions on the source side, returning how many writes completed.
func (w *wirePair) reap() (int, error) {
	n := wait(w.src, w.buf)
	d := 0
	for _, c := range w.buf[:n] {
		if c.Err != nil {
			return d, c.Err
		}
		if c.ID < 1<<40 {
			d++
		}
	}
	return d, nil
}

// MeasureBandwidth is the provider's bandwidth in bytes/s over one endpoint pair of
// rails rails: size bytes over the median time of several writes of them.
func MeasureBandwidth(provider string, rails, size int, cpus *unix.CPUSet) (float64, error) {
	d, err := medianWrite(provider, rails, size, 4<<20, 64, 5, cpus)
	return float64(size) / d.Seconds(), err
}

// wireFloor is the median time of a plain write of n bytes, signalled, on the provider.
func wireFloor(provider string, rails, n int, cpus *unix.CPUSet) (time.Duration, error) {
	d, err := medianWrite(provider, rails, n, 4<<20, 64, 9, cpus)
	if err != nil {
		return 0, fmt.Errorf("wire floor: %w", err)
	}
	return d, nil
}

// medianWrite opens an endpoint pair of rails rails, forms its connection, and returns
// the median time of rounds writes of n bytes, in chunk-byte writes with window in flight,
// each signalled.
func medianWrite(provider string, rails, n, chunk, window, rounds int, cpus *unix.CPUSet) (time.Duration, error) {
	w, err := newWirePair(provider, rails, n, cpus)
	if err != nil {
		return 0, err
	}
	defer w.close()
	if _, err := w.write(1<<20, 1<<20, 1); err != nil { // connection setup
		return 0, err
	}
	ds := make([]time.Duration, rounds)
	for i := range ds {
		if ds[i], err = w.write(n, chunk, window); err != nil {
			return 0, err
		}
	}
	slices.Sort(ds)
	return ds[len(ds)/2], nil
}

// wireFloorParallel is the median time for tp endpoint pairs to each write n/tp bytes at
// once, in writes equal writes all in flight, signalled: the same bytes spread over as
// many endpoints, in as many writes, as a TP handoff's merged writes (one per region).
func wireFloorParallel(provider string, rails, n, tp, writes int, cpus *unix.CPUSet) (time.Duration, error) {
	ds, err := wireFloorRounds(provider, rails, n, tp, writes, 9, cpus)
	if err != nil {
		return 0, err
	}
	return ds[len(ds)/2], nil
}

// wireFloorRounds is wireFloorParallel's rounds, sorted.
func wireFloorRounds(provider string, rails, n, tp, writes, rounds int, cpus *unix.CPUSet) ([]time.Duration, error) {
	chunk := (n/tp + writes - 1) / writes
	pairs := make([]*wirePair, tp)
	for i := range pairs {
		w, err := newWirePair(provider, rails, n/tp, cpus)
		if err != nil {
			return nil, fmt.Errorf("wire floor: %w", err)
		}
		defer w.close()
		if _, err := w.write(1<<20, 1<<20, 1); err != nil {
			return nil, err
		}
		pairs[i] = w
	}
	var ds []time.Duration
	for range rounds {
		start := time.Now()
		err := parallelPairs(pairs, func(w *wirePair) error { _, err := w.write(n/tp, chunk, writes); return err })
		if err != nil {
			return nil, err
		}
		ds = append(ds, time.Since(start))
	}
	slices.Sort(ds)
	return ds, nil
}

func parallelPairs(pairs []*wirePair, fn func(*wirePair) error) error {
	return parallel(len(pairs), func(i int) error { return fn(pairs[i]) })
}
