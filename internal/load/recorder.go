package load

import (
	"crypto/rand"
	"encoding/hex"
	"sync"
	"time"
)

// Recorder counts a router's load. Its methods are safe for concurrent use.
type Recorder struct {
	mu      sync.Mutex
	r       Report
	engines map[legKey]*tracker
}

type legKey struct {
	decode bool
	id     string
}

// tracker integrates one engine's legs in flight over time.
type tracker struct {
	inflight int
	since    time.Time // of the last change of inflight
	Engine
}

// NewRecorder returns a Recorder under a new Boot.
func NewRecorder() *Recorder {
	b := make([]byte, 8)
	_, _ = rand.Read(b)
	return &Recorder{r: Report{Boot: hex.EncodeToString(b), TTFT: map[string]Histogram{}}, engines: map[legKey]*tracker{}}
}

// Arrived counts a request and its prompt tokens.
func (r *Recorder) Arrived(tokens int) {
	r.mu.Lock()
	r.r.Requests++
	r.r.PromptTokens += uint64(max(tokens, 0))
	r.mu.Unlock()
}

// Leg marks a leg in flight on an engine from now; the returned func ends it, adding
// tokens (a completed prefill leg's prompt tokens; 0 otherwise).
func (r *Recorder) Leg(decode bool, engine string, now time.Time) (end func(now time.Time, tokens int)) {
	r.mu.Lock()
	t := r.tracker(decode, engine)
	t.advance(now)
	t.inflight++
	r.mu.Unlock()
	return func(now time.Time, tokens int) {
		r.mu.Lock()
		t.advance(now)
		t.inflight--
		t.Tokens += uint64(max(tokens, 0))
		r.mu.Unlock()
	}
}

// Gaps counts n token gaps of d on a decode engine.
func (r *Recorder) Gaps(engine string, d time.Duration, n int) {
	if n <= 0 {
		return
	}
	r.mu.Lock()
	r.tracker(true, engine).ITL.Observe(d, uint64(n))
	r.mu.Unlock()
}

// TTFT counts a served request's time to first byte under its engines.
func (r *Recorder) TTFT(prefill, decode string, d time.Duration) {
	r.mu.Lock()
	h := r.r.TTFT[PairKey(prefill, decode)]
	h.Observe(d, 1)
	r.r.TTFT[PairKey(prefill, decode)] = h
	r.mu.Unlock()
}

// Report is the counts now.
func (r *Recorder) Report(now time.Time) Report {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := r.r
	out.Prefill, out.Decode, out.TTFT = map[string]Engine{}, map[string]Engine{}, make(map[string]Histogram, len(r.r.TTFT))
	for k, h := range r.r.TTFT {
		out.TTFT[k] = append(Histogram(nil), h...)
	}
	for k, t := range r.engines {
		t.advance(now)
		e := t.Engine
		e.ITL = append(Histogram(nil), e.ITL...)
		if k.decode {
			out.Decode[k.id] = e
		} else {
			out.Prefill[k.id] = e
		}
	}
	return out
}

func (r *Recorder) tracker(decode bool, engine string) *tracker {
	k := legKey{decode, engine}
	t, ok := r.engines[k]
	if !ok {
		t = &tracker{}
		r.engines[k] = t
	}
	return t
}

func (t *tracker) advance(now time.Time) {
	if t.since.IsZero() {
		t.since = now
		return
	}
	if d := now.Sub(t.since).Seconds(); d > 0 {
		t.InFlight += d * float64(t.inflight)
		if t.inflight > 0 {
			t.Busy += d
		}
		t.since = now
	}
}
