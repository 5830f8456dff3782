package kvevents

import (
	"fmt"
	"net/http"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvhandoff/kvhandoff/internal/keystream"
)

const (
	// maxFollowers bounds the streams a sidecar serves at once: a router or picker
	// replica each.
	maxFollowers = 256
	// subscriberFrames is how many frames a slow follower may fall behind before it is
	// cut off (it reconnects and starts from a snapshot).
	subscriberFrames = 1024
)

// Server is a sidecar's state: the keys its engine holds, kept from vLLM's batches (Apply),
// and the followers it streams them to (ServeHTTP).
type Server struct {
	mu      sync.Mutex
	keys    *Keys
	seq     uint64
	started bool
	subs    map[chan []byte]struct{}
	m       *serverMetrics
}

// NewServer returns a hub over keys, counting into reg.
func NewServer(keys *Keys, reg prometheus.Registerer) *Server {
	h := &Server{keys: keys, subs: map[chan []byte]struct{}{}}
	h.m = newServerMetrics(reg, h)
	return h
}

// Apply folds a batch from vLLM into the keys and relays the change. vLLM numbers its
// batches from 0: a number that goes back means the engine restarted (its cache is
// empty); one that skips means batches were lost (what they changed is not known, so
// nothing held is trusted any more).
func (h *Server) Apply(b Batch) {
	h.mu.Lock()
	defer h.mu.Unlock()
	var out []byte
	switch {
	case h.started && b.Seq <= h.seq:
		out = h.reset("restarted", keystream.OpEmptied)
	case h.started && b.Seq > h.seq+1:
		out = h.reset("gap", keystream.OpSnapshot)
	}
	h.started, h.seq = true, b.Seq
	for _, e := range b.Events {
		h.m.events.WithLabelValues(e.Kind).Inc()
		c := h.keys.Apply(e)
		switch {
		case c.Cleared:
			out = keystream.AppendFrame(out, keystream.OpEmptied, nil)
		case len(c.Added) > 0:
			out = keystream.AppendFrame(out, keystream.OpAdd, c.Added)
		case len(c.Removed) > 0:
			out = keystream.AppendFrame(out, keystream.OpRemove, c.Removed)
		}
		for reason, n := range c.Skipped {
			h.m.skipped.WithLabelValues(reason).Add(float64(n))
		}
	}
	h.broadcast(out)
}

// Lost says the engine stopped (WatchEngine), and its cache with it; the next batch
// starts a new run of numbers.
func (h *Server) Lost() {
	h.mu.Lock()
	defer h.mu.Unlock()
	if !h.started && h.keys.Len() == 0 {
		return
	}
	h.started = false
	h.broadcast(h.reset("stopped", keystream.OpEmptied))
}

// Refused says a message could not be read: as a lost batch, nothing held is trusted.
func (h *Server) Refused() {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.broadcast(h.reset("refused", keystream.OpSnapshot))
}

// reset forgets the keys and returns the frame that tells the followers (op: keystream.OpEmptied
// when the engine's cache is gone, keystream.OpSnapshot when only the hub's knowledge of it is).
func (h *Server) reset(reason string, op byte) []byte {
	h.keys.Reset()
	h.m.resets.WithLabelValues(reason).Inc()
	return keystream.AppendFrame(nil, op, nil)
}

// broadcast relays frames to every follower; one too far behind is cut off (it
// reconnects and starts from a snapshot).
func (h *Server) broadcast(frames []byte) {
	if len(frames) == 0 {
		return
	}
	for ch := range h.subs {
		select {
		case ch <- frames:
		default:
			delete(h.subs, ch)
			close(ch)
			h.m.cutOff.Inc()
		}
	}
}

// ServeHTTP streams the keys: a snapshot, then every change, until the follower goes.
func (h *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	flush := http.NewResponseController(w)
	ch := make(chan []byte, subscriberFrames)
	h.mu.Lock()
	if len(h.subs) >= maxFollowers {
		h.mu.Unlock()
		http.Error(w, fmt.Sprintf("%d followers already: at most %d", maxFollowers, maxFollowers), http.StatusServiceUnavailable)
		return
	}
	// The snapshot is taken with the follower registered, under the lock Apply holds:
	// no change falls between them.
	all := h.keys.All()
	h.subs[ch] = struct{}{}
	h.mu.Unlock()
	defer func() {
		h.mu.Lock()
		if _, ok := h.subs[ch]; ok {
			delete(h.subs, ch)
			close(ch)
		}
		h.mu.Unlock()
	}()
	w.Header().Set("Content-Type", "application/octet-stream")
	snapshot := keystream.AppendFrame(nil, keystream.OpSnapshot, nil)
	for len(all) > 0 {
		n := min(len(all), keystream.MaxFrameKeys)
		snapshot = keystream.AppendFrame(snapshot, keystream.OpAdd, all[:n])
		all = all[n:]
	}
	if _, err := w.Write(snapshot); err != nil || flush.Flush() != nil {
		return
	}
	beat := time.NewTicker(keystream.Heartbeat)
	defer beat.Stop()
	for {
		var b []byte
		select {
		case <-r.Context().Done():
			return
		case <-beat.C:
			b = keystream.AppendFrame(nil, keystream.OpAdd, nil)
		case frames, ok := <-ch:
			if !ok {
				return
			}
			b = frames
		}
		if _, err := w.Write(b); err != nil || flush.Flush() != nil {
			return
		}
	}
}

type serverMetrics struct {
	events  *prometheus.CounterVec // kind
	skipped *prometheus.CounterVec // reason
	resets  *prometheus.CounterVec // reason
	cutOff  prometheus.Counter
}

func newServerMetrics(reg prometheus.Registerer, h *Server) *serverMetrics {
	m := &serverMetrics{
		events: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvhandoff_kv_events_total",
			Help: "vLLM KV cache events received, by kind (BlockStored, BlockRemoved, AllBlocksCleared).",
		}, []string{"kind"}),
		skipped: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvhandoff_kv_events_blocks_skipped_total",
			Help: "Stored blocks left out of the keys served, by reason: unkeyed (hashed with multimodal inputs or prompt embeddings), " +
				"no_parent (stored after a block not held), other_tier (not the GPU's full-attention cache), malformed, full (at --max-blocks).",
		}, []string{"reason"}),
		resets: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvhandoff_kv_events_resets_total",
			Help: "Times the keys held were dropped, by reason: restarted (vLLM's sequence went back), gap (batches lost), " +
				"stopped (the engine's API refused connections), refused (a message that could not be read).",
		}, []string{"reason"}),
		cutOff: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvhandoff_kv_events_followers_cut_off_total",
			Help: "Followers cut off for falling too far behind (they reconnect and start from a snapshot).",
		}),
	}
	held := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "kvhandoff_kv_events_blocks",
		Help: "Blocks the engine holds by its events, that the sidecar serves as keys.",
	}, func() float64 { h.mu.Lock(); defer h.mu.Unlock(); return float64(h.keys.Len()) })
	followers := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "kvhandoff_kv_events_followers",
		Help: "Routers and endpoint pickers following the keys.",
	}, func() float64 { h.mu.Lock(); defer h.mu.Unlock(); return float64(len(h.subs)) })
	for _, k := range []string{KindStored, KindRemoved, KindCleared} {
		m.events.WithLabelValues(k)
	}
	for _, r := range []string{"restarted", "gap", "stopped", "refused"} {
		m.resets.WithLabelValues(r)
	}
	reg.MustRegister(m.events, m.skipped, m.resets, m.cutOff, held, followers)
	return m
}
