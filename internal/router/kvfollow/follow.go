// Package kvfollow follows the kv-events sidecars of a pool's engines (package kvevents,
// in the engine pods) for a router or endpoint picker: per engine, the keys of the blocks
// it holds, from each sidecar's key stream (package keystream), matched against a
// prompt's keys in place of routing history while the stream is live.
package kvfollow

import (
	"bufio"
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvhandoff/kvhandoff/internal/keystream"
	"github.com/kvhandoff/kvhandoff/internal/router/discovery"
	"github.com/kvhandoff/kvhandoff/internal/router/prefix"
)

// Names are the follower's metrics' names in one component (router, endpoint picker).
type Names struct{ Live, Blocks, Resets string }

// Follower keeps, per engine whose sidecar serves its keys, an index of what the engine
// holds by its own events (Match); an engine whose stream is not live is not in it, and
// its choice falls back to the routing history.
type Follower struct {
	ix        *prefix.Index
	history   *prefix.Index
	tokenFile string
	client    *http.Client
	log       *slog.Logger
	resets    *prometheus.CounterVec // reason

	mu      sync.Mutex
	engines map[string]*followed
}

type followed struct {
	url  string
	stop context.CancelFunc
	live bool
}

// NewFollower returns a follower keeping at most maxBlocks keys an engine, presenting
// the token in tokenFile to the sidecars (read at each connection). An engine that
// empties its cache (it restarted) is cleared from history too, which learned its
// blocks from routing.
func NewFollower(maxBlocks int, tokenFile string, history *prefix.Index, reg prometheus.Registerer, names Names, log *slog.Logger) *Follower {
	f := &Follower{
		ix: prefix.NewIndex(maxBlocks), history: history, tokenFile: tokenFile, log: log, engines: map[string]*followed{},
		// No timeout: a stream lasts as long as the engine; silence is caught by heartbeats.
		client: &http.Client{Transport: &http.Transport{ResponseHeaderTimeout: 10 * time.Second, DisableCompression: true}},
		resets: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: names.Resets,
			Help: "Times an engine's KV events stream was dropped from the prefix index, by reason: down (the stream broke or fell silent; " +
				"the engine's choice falls back to routing history until it is back), emptied (the engine restarted or cleared its cache).",
		}, []string{"reason"}),
	}
	live := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: names.Live,
		Help: "Engines whose prefix index comes from their own KV cache events (for token-id prompts); the others' from routing history.",
	}, func() float64 { return float64(f.Live()) })
	blocks := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: names.Blocks,
		Help: "Blocks the engines hold by their KV cache events, all engines together (about 40 bytes each here).",
	}, func() float64 { return float64(f.Blocks()) })
	for _, r := range []string{"down", "emptied"} {
		f.resets.WithLabelValues(r)
	}
	reg.MustRegister(f.resets, live, blocks)
	return f
}

// Match is how many of keys' leading blocks engine holds by its events; ok is false when
// its events are not followed live (the caller then asks history).
func (f *Follower) Match(engine string, keys []prefix.Key) (n int, ok bool) {
	f.mu.Lock()
	e := f.engines[engine]
	ok = e != nil && e.live
	f.mu.Unlock()
	if !ok {
		return 0, false
	}
	return f.ix.Match(engine, keys), true
}

// Live is how many engines are followed live.
func (f *Follower) Live() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	n := 0
	for _, e := range f.engines {
		if e.live {
			n++
		}
	}
	return n
}

// Blocks is how many keys the index holds, all engines together.
func (f *Follower) Blocks() int { return f.ix.Total() }

// Sync follows the engines that serve their keys, and stops following any other.
func (f *Follower) Sync(engines []discovery.Engine) {
	want := map[string]string{}
	for _, e := range engines {
		if e.KVEventsURL != "" {
			want[e.EngineID] = e.KVEventsURL
		}
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	for id, e := range f.engines {
		if want[id] != e.url {
			e.stop()
			delete(f.engines, id)
			f.ix.Clear(id)
		}
	}
	for id, url := range want {
		if f.engines[id] == nil {
			ctx, stop := context.WithCancel(context.Background())
			e := &followed{url: url, stop: stop}
			f.engines[id] = e
			go f.follow(ctx, id, e)
		}
	}
}

// Stop stops following every engine (none for a nil follower).
func (f *Follower) Stop() {
	if f != nil {
		f.Sync(nil)
	}
}

// follow keeps the stream of e, engine's entry, open until ctx ends, reconnecting after a
// break.
func (f *Follower) follow(ctx context.Context, engine string, e *followed) {
	backoff := time.Second
	for ctx.Err() == nil {
		start := time.Now()
		err := f.stream(ctx, engine, e)
		if ctx.Err() != nil {
			return
		}
		f.apply(engine, e, func() {
			e.live = false
			f.ix.Clear(engine)
		})
		f.resets.WithLabelValues("down").Inc()
		f.log.Info("an engine's KV events stream broke; its prefix index falls back to routing history", "engine", engine, "url", e.url, "err", err)
		if time.Since(start) > time.Minute {
			backoff = time.Second
		}
		wait(ctx, backoff)
		backoff = min(2*backoff, 30*time.Second)
	}
}

// stream reads one stream of engine's keys into the index until it breaks.
func (f *Follower) stream(ctx context.Context, engine string, e *followed) error {
	url := e.url
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	token, err := keystream.ReadToken(f.tokenFile)
	if err != nil {
		return err
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url+keystream.StreamPath, nil)
	if err != nil {
		return err
	}
	req.Header.Set("Authorization", "Bearer "+token)
	resp, err := f.client.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("%s: %s", url+keystream.StreamPath, resp.Status)
	}
	// A stream silent for 3 heartbeats is dead, whatever TCP says.
	silent := time.AfterFunc(3*keystream.Heartbeat, cancel)
	defer silent.Stop()
	r := bufio.NewReaderSize(resp.Body, 64<<10)
	var keys []prefix.Key
	for {
		op, k, err := keystream.ReadFrame(r, keys)
		if err != nil {
			return err
		}
		keys = k
		silent.Reset(3 * keystream.Heartbeat)
		f.apply(engine, e, func() {
			switch op {
			case keystream.OpSnapshot:
				f.ix.Clear(engine)
				e.live = true
			case keystream.OpAdd:
				f.ix.Add(engine, keys)
			case keystream.OpRemove:
				f.ix.Remove(engine, keys)
			case keystream.OpEmptied:
				f.ix.Clear(engine)
				f.history.Clear(engine)
				f.resets.WithLabelValues("emptied").Inc()
			}
		})
	}
}

// apply runs change while e is still engine's entry: a stream that Sync has replaced (the
// engine's pod came back at another address) or dropped changes nothing any more.
func (f *Follower) apply(engine string, e *followed, change func()) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.engines[engine] == e {
		change()
	}
}

func wait(ctx context.Context, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
	case <-t.C:
	}
}
