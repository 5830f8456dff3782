// Package openai is the simulated engine's HTTP front end: it answers the endpoints of
// vLLM's OpenAI server that a P/D router uses (/v1/completions, /v1/chat/completions,
// /v1/models, /health, /metrics) the way vLLM does, including kv_transfer_params on both
// legs. Prefill takes the modelled time and produces the request's KV; decode receives
// it — through transfer agents (AgentKV) or an in-process exchange (LocalKV) — before
// its first token. Generated tokens are a deterministic function of the prompt, so a
// test can tell which prompt's tokens a client got and compare P/D output with one
// engine's.
package vllmserver

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"hash/fnv"
	"log/slog"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvhandoff/kvhandoff/internal/router/protocol"
)

// Config is one simulated engine.
type Config struct {
	// EngineID is the engine's vLLM engine_id.
	EngineID string
	// Model is the one model the engine serves.
	Model string
	// SideChannelHost and SideChannelPort are what a prefill engine returns as
	// remote_host and remote_port (vLLM's NIXL side channel).
	SideChannelHost string
	SideChannelPort int
	// TP is the engine's tensor-parallel size, returned as tp_size.
	TP int
	// PrefillTime is how long prefill of a prompt takes (nil: no time), for example
	// simengine.Prefill's Time. One prefill runs at a time, as on one engine.
	PrefillTime func(tokens int) time.Duration
	// TPOT is the time per output token, plus TPOTPerStream for every request the
	// engine is generating for: a decode step's time grows with its batch.
	TPOT, TPOTPerStream time.Duration
	// KV moves the KV between engines; nil serves requests without P/D (no KV moves).
	KV KV
	// PrefixCacheBlocks, when not 0, gives the engine a prefix cache of that many blocks
	// of BlockSize tokens (0: 16), as vLLM's: the leading whole blocks of a prompt the
	// engine holds are not computed again (prefill time counts the rest), nor moved to it
	// (a decode leg takes only the tail); it keeps the blocks of every prompt it computed
	// or received, least recently used first out.
	PrefixCacheBlocks, BlockSize int
	Log                          *slog.Logger
}

// KV is how a simulated engine hands a request's KV to another.
type KV interface {
	// Produce runs in a prefill engine's loop as prefill starts: it makes the request's KV
	// under key while the prefill computes, until done, and returns the block ids the KV is
	// in and publish, which offers the KV for transfer. The engine calls publish off its
	// loop, as vLLM's connector reports blocks from its own thread: the next prefill never
	// waits for the agent.
	Produce(ctx context.Context, key string, tokens int, done time.Time) (blocks []uint32, publish func(context.Context) error, err error)
	// Receive runs on a decode engine and returns once the request's KV is in its cache
	// and verified, from block position first on (the engine holds the blocks before).
	// Push (src.Blocks nil): it registers its blocks with the prefill engine at once and
	// waits for the writes. Pull: it reads src.Blocks from first on.
	Receive(ctx context.Context, key string, tokens, first int, src Source) error
}

// Source is the prefill engine a decode leg names in its kv_transfer_params.
type Source struct {
	EngineID string
	Host     string
	Port     int
	TP       int
	Blocks   []uint32
}

// Received is one request as the engine saw it, for tests.
type Received struct {
	Path      string
	RequestID string
	Body      []byte
	Arrived   time.Time
	// Answered is when the response's first byte went out (zero if it never did).
	Answered time.Time
	// Response is the whole response, when it was not streamed.
	Response []byte
	// Cancelled is true when the client went away before the response ended.
	Cancelled bool
}

// Server is a simulated engine's HTTP front end.
type Server struct {
	cfg     Config
	mux     *http.ServeMux
	prefill sync.Mutex // one prefill at a time
	cache   *prefixCache

	running, waiting atomic.Int64
	mu               sync.Mutex
	seen             []*Received
	// Fail makes every completion answer with this status (0: none), for failure tests.
	Fail atomic.Int32
}

// New returns the front end of one engine.
func New(cfg Config) *Server {
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	if cfg.BlockSize <= 0 {
		cfg.BlockSize = 16
	}
	s := &Server{cfg: cfg, mux: http.NewServeMux(), cache: newPrefixCache(cfg.PrefixCacheBlocks, cfg.BlockSize)}
	s.mux.HandleFunc("POST /v1/completions", s.complete(false))
	s.mux.HandleFunc("POST /v1/chat/completions", s.complete(true))
	s.mux.HandleFunc("GET /v1/models", s.models)
	s.mux.HandleFunc("GET /health", func(http.ResponseWriter, *http.Request) {})
	s.mux.HandleFunc("GET /metrics", s.metrics)
	return s
}

func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) { s.mux.ServeHTTP(w, r) }

// PrefixCache returns the engine's prefix-cache queries and hits so far, in tokens.
func (s *Server) PrefixCache() (queries, hits int64) { return s.cache.counts() }

// Seen returns a copy of every completion request received so far.
func (s *Server) Seen() []Received {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]Received, len(s.seen))
	for i, r := range s.seen {
		out[i] = *r
	}
	return out
}

func (s *Server) models(w http.ResponseWriter, _ *http.Request) {
	writeJSON(w, http.StatusOK, map[string]any{"object": "list", "data": []any{
		map[string]any{"id": s.cfg.Model, "object": "model", "created": 0, "owned_by": "vllm", "root": s.cfg.Model, "max_model_len": 131072},
	}})
}

// metrics exports the gauges a router balances on, under vLLM's names.
func (s *Server) metrics(w http.ResponseWriter, _ *http.Request) {
	w.Header().Set("Content-Type", "text/plain; version=0.0.4")
	labels := fmt.Sprintf(`{engine="0",model_name=%q}`, s.cfg.Model)
	fmt.Fprintf(w, "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running%s %d\n", labels, s.running.Load())
	fmt.Fprintf(w, "# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting%s %d\n", labels, s.waiting.Load())
	usage := 0.0
	if u, ok := s.cfg.KV.(interface{ Usage() float64 }); ok {
		usage = u.Usage()
	}
	fmt.Fprintf(w, "# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc%s %g\n", labels, usage)
	if s.cache != nil {
		q, h := s.cache.counts()
		fmt.Fprintf(w, "# TYPE vllm:cache_config_info gauge\nvllm:cache_config_info{block_size=\"%d\",engine=\"0\",num_gpu_blocks=\"%d\"} 1.0\n",
			s.cfg.BlockSize, s.cfg.PrefixCacheBlocks)
		fmt.Fprintf(w, "# TYPE vllm:prefix_cache_queries_total counter\nvllm:prefix_cache_queries_total%s %d\n", labels, q)
		fmt.Fprintf(w, "# TYPE vllm:prefix_cache_hits_total counter\nvllm:prefix_cache_hits_total%s %d\n", labels, h)
	}
}

// apiError answers like vLLM's OpenAI server.
func apiError(w http.ResponseWriter, status int, typ, msg string) {
	writeJSON(w, status, map[string]any{"error": map[string]any{"message": msg, "type": typ, "param": nil, "code": status}})
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

// request is a parsed completion request.
type request struct {
	chat      bool
	id        string
	prompt    []string // tokens
	maxTokens int
	stream    bool
	usage     bool
	params    map[string]json.RawMessage // kv_transfer_params, nil if absent
}

func (s *Server) parse(chat bool, r *http.Request, data []byte) (*request, int, error) {
	b, err := protocol.Parse(data)
	if err != nil {
		return nil, http.StatusBadRequest, err
	}
	rq := &request{chat: chat, id: r.Header.Get("X-Request-Id"), maxTokens: 16}
	if rq.id == "" {
		rq.id = fmt.Sprintf("%x", fnv64(string(data), time.Now().String()))
	}
	var model string
	if err := json.Unmarshal(b["model"], &model); err != nil || model != s.cfg.Model {
		return nil, http.StatusNotFound, fmt.Errorf("The model `%s` does not exist.", model)
	}
	for _, k := range []string{"max_tokens", "max_completion_tokens"} {
		if raw, ok := b[k]; ok && string(raw) != "null" {
			if err := json.Unmarshal(raw, &rq.maxTokens); err != nil || rq.maxTokens < 1 {
				return nil, http.StatusBadRequest, fmt.Errorf("%s must be an integer of at least 1, got %s", k, raw)
			}
		}
	}
	var minTokens int
	if raw, ok := b["min_tokens"]; ok && string(raw) != "null" {
		if err := json.Unmarshal(raw, &minTokens); err != nil || minTokens > rq.maxTokens {
			return nil, http.StatusBadRequest, fmt.Errorf("min_tokens (%s) must be less than or equal to max_tokens (%d)", raw, rq.maxTokens)
		}
	}
	rq.stream = b.Stream()
	var so struct {
		IncludeUsage bool `json:"include_usage"`
	}
	if raw, ok := b["stream_options"]; ok && string(raw) != "null" {
		if !rq.stream {
			return nil, http.StatusBadRequest, errors.New("Stream options can only be defined when `stream=True`.")
		}
		if err := json.Unmarshal(raw, &so); err != nil {
			return nil, http.StatusBadRequest, fmt.Errorf("stream_options: %v", err)
		}
	}
	rq.usage = so.IncludeUsage
	if rq.prompt, err = promptOf(chat, b); err != nil {
		return nil, http.StatusBadRequest, err
	}
	if raw, ok := b[protocol.KVTransferParams]; ok && string(raw) != "null" {
		if err := json.Unmarshal(raw, &rq.params); err != nil {
			return nil, http.StatusBadRequest, fmt.Errorf("kv_transfer_params must be an object: %v", err)
		}
	}
	return rq, 0, nil
}

// promptOf tokenizes a prompt: text by words, token ids as given.
func promptOf(chat bool, b protocol.Body) ([]string, error) {
	if chat {
		var msgs []struct {
			Role    string `json:"role"`
			Content string `json:"content"`
		}
		if err := json.Unmarshal(b["messages"], &msgs); err != nil || len(msgs) == 0 {
			return nil, errors.New("messages must be a non-empty list of {role, content}")
		}
		var toks []string
		for _, m := range msgs {
			toks = append(toks, "<"+m.Role+">")
			toks = append(toks, strings.Fields(m.Content)...)
		}
		return toks, nil
	}
	var text string
	if json.Unmarshal(b["prompt"], &text) == nil {
		if strings.TrimSpace(text) == "" {
			return nil, errors.New("prompt must not be empty")
		}
		return strings.Fields(text), nil
	}
	var ids []int64
	if err := json.Unmarshal(b["prompt"], &ids); err != nil || len(ids) == 0 {
		return nil, errors.New("prompt must be a non-empty string or list of token ids")
	}
	toks := make([]string, len(ids))
	for i, id := range ids {
		toks[i] = fmt.Sprint(id)
	}
	return toks, nil
}

// Output is the text a simulated engine generates for a prompt: n tokens, each a
// function of the whole prompt and its position, the same on every engine.
func Output(prompt []string, n int) []string {
	h := fnv64(prompt...)
	out := make([]string, n)
	for i := range out {
		out[i] = " " + vocabulary[(h^uint64(i)*0x9E3779B97F4A7C15)%uint64(len(vocabulary))]
	}
	return out
}

var vocabulary = strings.Fields(`alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike
november oscar papa quebec romeo sierra tango uniform victor whiskey xray yankee zulu amber basil cedar dune
ember fern grove heron iris jade kestrel lotus maple nectar olive pine quartz raven sage thyme umber violet
willow yarrow zinnia acorn birch clover daisy elm fig ginger hazel ivy juniper kelp`)

func fnv64(parts ...string) uint64 {
	h := fnv.New64a()
	for _, p := range parts {
		h.Write([]byte(p))
		h.Write([]byte{0})
	}
	return h.Sum64()
}

func (s *Server) complete(chat bool) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		var buf bytes.Buffer
		_, _ = buf.ReadFrom(r.Body)
		rec := &Received{Path: r.URL.Path, RequestID: r.Header.Get("X-Request-Id"), Body: buf.Bytes(), Arrived: time.Now()}
		s.mu.Lock()
		s.seen = append(s.seen, rec)
		s.mu.Unlock()
		defer func() {
			if r.Context().Err() != nil {
				s.mu.Lock()
				rec.Cancelled = true
				s.mu.Unlock()
			}
		}()
		answered := func(body []byte) {
			s.mu.Lock()
			if rec.Answered.IsZero() {
				rec.Answered, rec.Response = time.Now(), body
			}
			s.mu.Unlock()
		}
		if st := s.Fail.Load(); st != 0 {
			// An engine that fails does so after its prefill time, as one that crashes
			// mid-prefill would.
			if s.cfg.PrefillTime != nil {
				select {
				case <-time.After(s.cfg.PrefillTime(0)):
				case <-r.Context().Done():
				}
			}
			apiError(w, int(st), "InternalServerError", "injected failure")
			return
		}
		rq, status, err := s.parse(chat, r, buf.Bytes())
		if err != nil {
			apiError(w, status, "BadRequestError", err.Error())
			return
		}
		s.serve(w, r, rq, answered)
	}
}

// serve runs a parsed request: a prefill leg, a decode leg or a whole request.
func (s *Server) serve(w http.ResponseWriter, r *http.Request, rq *request, answered func([]byte)) {
	ctx := r.Context()
	var returned map[string]any
	s.waiting.Add(1)
	keys := s.cache.keys(rq.prompt)
	cached := s.cache.lookup(keys, len(rq.prompt))
	switch {
	case flag(rq.params, protocol.DoRemoteDecode):
		// Prefill leg: compute, produce the KV for a remote decode, return one token and
		// what the decode engine needs to find the KV.
		key := rq.id
		if tid := str(rq.params, protocol.TransferID); tid != "" {
			key = tid // push: both legs share the transfer id
		}
		blocks, err := s.runPrefill(ctx, key, len(rq.prompt), cached)
		if err != nil {
			s.waiting.Add(-1)
			s.failRequest(w, ctx, err)
			return
		}
		if len(blocks) == 0 {
			blocks = []uint32{} // encoded as [], never null
		}
		returned = map[string]any{
			protocol.DoRemotePrefill: true, protocol.DoRemoteDecode: false,
			protocol.RemoteBlockIDs: [][]uint32{blocks}, protocol.RemoteEngineID: s.cfg.EngineID,
			protocol.RemoteRequestID: key, protocol.RemoteHost: s.cfg.SideChannelHost,
			protocol.RemotePort: s.cfg.SideChannelPort, protocol.TPSize: max(s.cfg.TP, 1),
		}
		rq.maxTokens = 1
	case flag(rq.params, protocol.DoRemotePrefill):
		// Decode leg: the KV comes from the prefill engine named in the params.
		src, key, err := sourceOf(rq)
		if err != nil {
			s.waiting.Add(-1)
			apiError(w, http.StatusBadRequest, "BadRequestError", err.Error())
			return
		}
		if s.cfg.KV != nil {
			if err := s.cfg.KV.Receive(ctx, key, len(rq.prompt), cached/s.cfg.BlockSize, src); err != nil {
				s.waiting.Add(-1)
				s.failRequest(w, ctx, err)
				return
			}
		}
	default:
		if _, err := s.runPrefill(ctx, "", len(rq.prompt), cached); err != nil {
			s.waiting.Add(-1)
			s.failRequest(w, ctx, err)
			return
		}
	}
	s.waiting.Add(-1)
	s.cache.add(keys) // computed or received: the engine holds the prompt's blocks now
	s.running.Add(1)
	defer s.running.Add(-1)
	s.respond(w, r, rq, Output(rq.prompt, rq.maxTokens), returned, answered)
}

func (s *Server) failRequest(w http.ResponseWriter, ctx context.Context, err error) {
	if ctx.Err() != nil {
		return // the client is gone; there is no one to answer
	}
	s.cfg.Log.Error("request failed", "engine", s.cfg.EngineID, "err", err)
	apiError(w, http.StatusInternalServerError, "InternalServerError", err.Error())
}

// runPrefill waits for the engine, then takes the modelled time of the tokens it does
// not hold (cached of them it does), producing the KV meanwhile, and publishes the KV
// once the engine has moved on to the next prefill.
func (s *Server) runPrefill(ctx context.Context, key string, tokens, cached int) ([]uint32, error) {
	s.prefill.Lock()
	done := time.Now()
	if s.cfg.PrefillTime != nil {
		done = done.Add(s.cfg.PrefillTime(tokens - cached))
	}
	if key == "" || s.cfg.KV == nil {
		defer s.prefill.Unlock()
		return nil, sleepUntil(ctx, done)
	}
	blocks, publish, err := s.cfg.KV.Produce(ctx, key, tokens, done)
	s.prefill.Unlock()
	if err != nil {
		return nil, err
	}
	return blocks, publish(ctx)
}

// sleepUntil waits until t or until ctx ends.
func sleepUntil(ctx context.Context, t time.Time) error {
	timer := time.NewTimer(time.Until(t))
	defer timer.Stop()
	select {
	case <-timer.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// sourceOf reads a decode leg's params the way vLLM's schedulers do.
func sourceOf(rq *request) (Source, string, error) {
	p := rq.params
	src := Source{EngineID: str(p, protocol.RemoteEngineID), Host: str(p, protocol.RemoteHost)}
	_ = json.Unmarshal(p[protocol.RemotePort], &src.Port)
	_ = json.Unmarshal(p[protocol.TPSize], &src.TP)
	if src.EngineID == "" || src.Host == "" || src.Port <= 0 || src.TP <= 0 {
		return src, "", fmt.Errorf("kv_transfer_params with do_remote_prefill need remote_engine_id, remote_host, remote_port and tp_size, got %s", mustJSON(p))
	}
	key := str(p, protocol.TransferID) // push
	if raw, ok := p[protocol.RemoteBlockIDs]; ok && string(raw) != "null" {
		blocks, err := blockIDs(raw)
		if err != nil {
			return src, "", err
		}
		if len(blocks) > 0 {
			src.Blocks = blocks
			key = str(p, protocol.RemoteRequestID) // pull
		}
	}
	if key == "" {
		return src, "", errors.New("kv_transfer_params need transfer_id (push) or remote_block_ids and remote_request_id (pull)")
	}
	return src, key, nil
}

// blockIDs accepts vLLM's per-group lists ([[1,2]]) and the older flat list ([1,2]).
func blockIDs(raw json.RawMessage) ([]uint32, error) {
	var groups [][]uint32
	if json.Unmarshal(raw, &groups) == nil {
		if len(groups) > 1 {
			return nil, fmt.Errorf("remote_block_ids has %d KV-cache groups; the simulated engine has one", len(groups))
		}
		if len(groups) == 1 {
			return groups[0], nil
		}
		return nil, nil
	}
	var flat []uint32
	if err := json.Unmarshal(raw, &flat); err != nil {
		return nil, fmt.Errorf("remote_block_ids must be a list of block ids: %v", err)
	}
	return flat, nil
}

func flag(p map[string]json.RawMessage, k string) bool {
	var v bool
	return json.Unmarshal(p[k], &v) == nil && v
}

func str(p map[string]json.RawMessage, k string) string {
	var v string
	_ = json.Unmarshal(p[k], &v)
	return v
}

func mustJSON(v any) string {
	b, _ := json.Marshal(v)
	return string(b)
}
