// Package discovery tells the router which engines it may send legs to. A Source
// delivers Sets: from a DecodePool and its PrefillPool in the cluster (cluster.go), or
// from a JSON file shaped like their status outside one (file.go).
package discovery

import (
	"context"
	"errors"
	"fmt"
	"net/url"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
)

// Engine is one engine the router may use, as the pools' status publishes it.
type Engine struct {
	// URL is the engine's OpenAI API (http://198.18.0.1:8000).
	URL string `json:"url"`
	// EngineID is the engine's vLLM engine_id.
	EngineID string `json:"engineID"`
	// Host and SideChannelPort are the engine's KV side channel: for executor Agent, its
	// node's transfer agent.
	Host            string `json:"host,omitempty"`
	SideChannelPort int32  `json:"sideChannelPort,omitempty"`
	// TensorParallelSize and PipelineParallelSize are what the engine runs with.
	TensorParallelSize   int32 `json:"tensorParallelSize,omitempty"`
	PipelineParallelSize int32 `json:"pipelineParallelSize,omitempty"`
	// CompatHash is the engine's kvhandoff.io/compat-hash. A prefill and a decode engine
	// are paired only when theirs are equal (both empty counts as equal).
	CompatHash string `json:"compatHash,omitempty"`
	// KVEventsURL is the engine's KV events sidecar (http://198.18.0.1:8102), which
	// serves the keys of the blocks its engine holds (package kvevents); "" for none.
	KVEventsURL string `json:"kvEventsURL,omitempty"`
}

// Set is everything the router routes over at one moment. Only eligible engines are in
// it: those whose pods are Ready.
type Set struct {
	// Mode is the DecodePool's policy's mode: Push or Pull.
	Mode kvv1.TransferMode `json:"mode"`
	// HandoffFailurePolicy is the policy's: Fail ("" too) or ServeOnDecode.
	HandoffFailurePolicy kvv1.HandoffFailurePolicy `json:"handoffFailurePolicy,omitempty"`
	// HandoffFailureLimitPercent is the policy's: the share of requests whose handoff may
	// fail (or fall back) over the health window before the router reports HandoffFailures.
	// nil: 5, the policy's default.
	HandoffFailureLimitPercent *int32 `json:"handoffFailureLimitPercent,omitempty"`
	// HealthWindowSeconds is the policy's: how far back the health report looks. 0: the
	// router's --health-window.
	HealthWindowSeconds int32 `json:"healthWindowSeconds,omitempty"`
	// Routing is the policy's routing: how decode engines are chosen and which requests
	// skip prefill. nil: by load alone, every request through prefill.
	Routing *kvv1.RoutingSpec `json:"routing,omitempty"`
	// BlockSize is the engines' KV block size in tokens (the DecodePool's blockSize),
	// which prompts are cut at for the prefix index. 0: 16, vLLM's default.
	BlockSize int `json:"blockSize,omitempty"`
	// Prefill and Decode are the eligible engines of each pool.
	Prefill []Engine `json:"prefill"`
	Decode  []Engine `json:"decode"`
	// Source names where the set came from (file path, namespace/DecodePool), for
	// errors and logs.
	Source string `json:"-"`
}

// Validate reports the first field that a router cannot route with, naming it.
func (s *Set) Validate() error {
	if s.Mode != kvv1.TransferPush && s.Mode != kvv1.TransferPull {
		return fmt.Errorf("mode is %q: must be Push or Pull", s.Mode)
	}
	switch s.HandoffFailurePolicy {
	case "", kvv1.HandoffFailureFail, kvv1.HandoffFailureServeOnDecode:
	default:
		return fmt.Errorf("handoffFailurePolicy is %q: must be Fail or ServeOnDecode", s.HandoffFailurePolicy)
	}
	if l := s.HandoffFailureLimitPercent; l != nil && (*l < 0 || *l > 100) {
		return fmt.Errorf("handoffFailureLimitPercent is %d: must be 0 to 100", *l)
	}
	if s.HealthWindowSeconds < 0 {
		return fmt.Errorf("healthWindowSeconds is %d: must be a number of seconds, or 0 for the router's --health-window", s.HealthWindowSeconds)
	}
	if err := validRouting(s.Routing); err != nil {
		return err
	}
	if s.BlockSize < 0 {
		return fmt.Errorf("blockSize is %d: must be a positive number of tokens", s.BlockSize)
	}
	var errs []error
	check := func(role string, engines []Engine) {
		seen := map[string]bool{}
		for i, e := range engines {
			field := fmt.Sprintf("%s[%d]", role, i)
			if u, err := url.Parse(e.URL); err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
				errs = append(errs, fmt.Errorf("%s.url %q: must be an http:// or https:// URL with a host", field, e.URL))
			}
			if e.KVEventsURL != "" {
				if u, err := url.Parse(e.KVEventsURL); err != nil || u.Scheme != "http" || u.Host == "" || u.Path != "" {
					errs = append(errs, fmt.Errorf("%s.kvEventsURL %q: must be an http:// URL of a host and port alone", field, e.KVEventsURL))
				}
			}
			if e.EngineID == "" {
				errs = append(errs, fmt.Errorf("%s.engineID: must be set (the engine's vLLM engine_id)", field))
			} else if seen[e.EngineID] {
				errs = append(errs, fmt.Errorf("%s.engineID %q: appears twice", field, e.EngineID))
			}
			seen[e.EngineID] = true
			if role == "prefill" && s.Mode == kvv1.TransferPush {
				// A push decode leg names these before prefill has run: without them the
				// decode engine cannot register its blocks.
				if e.Host == "" || e.SideChannelPort <= 0 || e.TensorParallelSize <= 0 {
					errs = append(errs, fmt.Errorf("%s: host, sideChannelPort and tensorParallelSize must be set in Push mode", field))
				}
			}
		}
	}
	check("prefill", s.Prefill)
	check("decode", s.Decode)
	return errors.Join(errs...)
}

// WithDecode is the set with the decode engine of URL u alone (none when it is not ready).
func (s *Set) WithDecode(u string) *Set {
	out := *s
	out.Decode = nil
	for _, d := range s.Decode {
		if d.URL == u {
			out.Decode = append(out.Decode, d)
		}
	}
	return &out
}

// Source delivers the current Set whenever it changes, starting with the first one.
type Source interface {
	// Run sends sets to out until ctx ends or the source fails for good.
	Run(ctx context.Context, out chan<- *Set) error
}

// Follow runs src and hands every set it sends to update, until ctx ends (nil) or src
// fails for good.
func Follow(ctx context.Context, src Source, update func(*Set)) error {
	sets := make(chan *Set)
	errc := make(chan error, 1)
	go func() { errc <- src.Run(ctx, sets) }()
	for {
		select {
		case set := <-sets:
			update(set)
		case err := <-errc:
			if err != nil {
				return fmt.Errorf("discovering engines: %w", err)
			}
			<-ctx.Done()
			return nil
		case <-ctx.Done():
			return nil
		}
	}
}

// validRouting checks a routing the API server did not (a file's): the CRD's rules.
func validRouting(r *kvv1.RoutingSpec) error {
	if r == nil {
		return nil
	}
	switch r.DecodeChoice {
	case "", kvv1.DecodeChoiceLoadOnly, kvv1.DecodeChoicePrefixAware:
	default:
		return fmt.Errorf("routing.decodeChoice is %q: must be LoadOnly or PrefixAware", r.DecodeChoice)
	}
	if r.OverlapWeight < 0 || r.OverlapWeight > 1000 {
		return fmt.Errorf("routing.overlapWeight is %d: must be 0 to 1000", r.OverlapWeight)
	}
	if r.LoadWeight < 0 || r.LoadWeight > 1000 {
		return fmt.Errorf("routing.loadWeight is %d: must be 1 to 1000 (0: 1)", r.LoadWeight)
	}
	if r.MinPrefillTokens < 0 {
		return fmt.Errorf("routing.minPrefillTokens is %d: must be 0 or more", r.MinPrefillTokens)
	}
	return nil
}
