// Package balance chooses the engines of each request's legs.
//
// Prefill engines are chosen by the fewest outstanding prompt tokens: prefill time grows
// with (and faster than) the tokens queued, so tokens, not requests, measure the wait.
// Decode engines are chosen by the fewest outstanding requests, refined by what the
// engine itself exports (vLLM's running and waiting requests and KV-cache usage): a
// decode engine's step time grows with its batch, and a full KV cache makes it queue or
// preempt. The router's own counts are fresh but see only this replica's requests; the
// engine's are global but as old as the last scrape, so the larger of the two counts.
// Ties go to the engine picked least, so equal engines take turns.
package balance

import (
	"math"
	"sync"
	"time"

	"github.com/kvhandoff/kvhandoff/internal/router/discovery"
)

// Load is what an engine exports about itself (vLLM's /metrics).
type Load struct {
	Running, Waiting float64
	// KVUsage is the fraction of the KV cache in use, 0 to 1.
	KVUsage float64
	// Blocks is the KV cache's size in blocks (vllm:cache_config_info's num_gpu_blocks);
	// 0 when not exported.
	Blocks int
	At     time.Time
}

// kvFull is the KV-cache usage above which a decode engine is avoided while another has
// room: new requests there wait for blocks or preempt running ones.
const kvFull = 0.95

// Balancer tracks every engine's outstanding legs and exported load.
type Balancer struct {
	// Stale is how old a scraped load may be and still count.
	Stale time.Duration
	// OnLoad, when set before Follow starts, is told every load Follow reads.
	OnLoad func(Role, string, Load)
	now    func() time.Time

	mu      sync.Mutex
	engines map[string]*state // by role/engine id
}

type state struct {
	requests, tokens int
	picks            uint64
	load             Load
}

// New returns a balancer that ignores loads older than stale.
func New(stale time.Duration) *Balancer {
	return &Balancer{Stale: stale, now: time.Now, engines: map[string]*state{}}
}

// Role names the pool an engine belongs to.
type Role string

const (
	Prefill Role = "prefill"
	Decode  Role = "decode"
)

func key(r Role, id string) string { return string(r) + "/" + id }

func (b *Balancer) get(r Role, id string) *state {
	k := key(r, id)
	s, ok := b.engines[k]
	if !ok {
		s = &state{}
		b.engines[k] = s
	}
	return s
}

// SetLoad records an engine's exported load.
func (b *Balancer) SetLoad(r Role, id string, l Load) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.get(r, id).load = l
}

// Forget drops the state of engines that are no longer in the set, keeping those with
// legs in flight until they end.
func (b *Balancer) Forget(s *discovery.Set) {
	keep := map[string]bool{}
	for _, e := range s.Prefill {
		keep[key(Prefill, e.EngineID)] = true
	}
	for _, e := range s.Decode {
		keep[key(Decode, e.EngineID)] = true
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	for k, st := range b.engines {
		if !keep[k] && st.requests == 0 {
			delete(b.engines, k)
		}
	}
}

// Outstanding reports an engine's legs in flight and their prompt tokens.
func (b *Balancer) Outstanding(r Role, id string) (requests, tokens int) {
	b.mu.Lock()
	defer b.mu.Unlock()
	s := b.get(r, id)
	return s.requests, s.tokens
}

// Acquire counts a leg on an engine until the returned release is called.
func (b *Balancer) Acquire(r Role, id string, tokens int) (release func()) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.count(b.get(r, id), tokens)
}

// count adds a leg to s; b.mu is held.
func (b *Balancer) count(s *state, tokens int) (release func()) {
	s.requests++
	s.tokens += tokens
	var once sync.Once
	return func() {
		once.Do(func() {
			b.mu.Lock()
			s.requests--
			s.tokens -= tokens
			b.mu.Unlock()
		})
	}
}

// Take picks the best engine of role among candidates and counts a leg of tokens on it
// in one step under the lock, so concurrent requests see each other's choices (picking
// first and counting later sent a burst of requests to one engine); release ends the
// count. ok is false when no candidate is left.
func (b *Balancer) Take(r Role, candidates []discovery.Engine, tokens int) (e discovery.Engine, release func(), ok bool) {
	return b.TakeScored(r, candidates, tokens, nil)
}

// TakeScored is Take with each candidate's load score (lower is better) passed through
// adjust(i, score) first: what else than load weighs the choice (the prefix an engine
// holds). nil adjusts nothing.
func (b *Balancer) TakeScored(r Role, candidates []discovery.Engine, tokens int, adjust func(i int, score float64) float64) (e discovery.Engine, release func(), ok bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if e, ok = b.pick(r, candidates, adjust); !ok {
		return e, func() {}, false
	}
	return e, b.count(b.get(r, e.EngineID), tokens), true
}

// Pick returns the best engine of role among candidates without counting a leg on it (for
// calls that are not legs), or false when there is none.
func (b *Balancer) Pick(r Role, candidates []discovery.Engine) (discovery.Engine, bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.pick(r, candidates, nil)
}

func (b *Balancer) pick(r Role, candidates []discovery.Engine, adjust func(int, float64) float64) (discovery.Engine, bool) {
	now := b.now()
	best, bestScore := -1, math.Inf(1)
	var bestPicks uint64
	for i, e := range candidates {
		s := b.get(r, e.EngineID)
		score := b.score(r, s, now)
		if adjust != nil {
			score = adjust(i, score)
		}
		if best < 0 || score < bestScore || (score == bestScore && s.picks < bestPicks) {
			best, bestScore, bestPicks = i, score, s.picks
		}
	}
	if best < 0 {
		return discovery.Engine{}, false
	}
	b.get(r, candidates[best].EngineID).picks++
	return candidates[best], true
}

func (b *Balancer) score(r Role, s *state, now time.Time) float64 {
	fresh := !s.load.At.IsZero() && now.Sub(s.load.At) <= b.Stale
	if r == Prefill {
		score := float64(s.tokens)
		if fresh {
			// Requests queued inside the engine (from other routers) break ties.
			score += s.load.Waiting / 1e3
		}
		return score
	}
	score := float64(s.requests)
	if fresh {
		score = math.Max(score, s.load.Running+s.load.Waiting)
		if s.load.KVUsage >= kvFull {
			score += 1e6
		}
		score += s.load.KVUsage / 1e3
	}
	return score
}
