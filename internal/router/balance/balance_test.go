package balance

import (
	"strings"
	"testing"
	"time"

	"github.com/kvhandoff/kvhandoff/internal/router/discovery"
)

func engines(ids ...string) []discovery.Engine {
	out := make([]discovery.Engine, len(ids))
	for i, id := range ids {
		out[i] = discovery.Engine{EngineID: id}
	}
	return out
}

func TestPrefillGoesToTheFewestOutstandingPromptTokens(t *testing.T) {
	b := New(time.Minute)
	defer b.Acquire(Prefill, "a", 16000)()
	b.Acquire(Prefill, "b", 2000)
	b.Acquire(Prefill, "b", 2000) // b: two short prompts, fewer tokens than a's one long one
	if e, _ := b.Pick(Prefill, engines("a", "b")); e.EngineID != "b" {
		t.Errorf("picked %s; b has 4000 tokens outstanding against a's 16000", e.EngineID)
	}
	if _, ok := b.Pick(Prefill, nil); ok {
		t.Error("picked an engine among none")
	}
}

// Take counts the leg in the same step as it picks: a burst of requests that all pick
// before any leg is counted would otherwise land on one engine.
func TestABurstOfTakesSpreadsOverEqualEngines(t *testing.T) {
	b := New(time.Minute)
	got := map[string]int{}
	for range 8 {
		e, _, _ := b.Take(Prefill, engines("a", "b"), 1000)
		got[e.EngineID]++
	}
	if got["a"] != 4 || got["b"] != 4 {
		t.Errorf("8 takes went %v, want 4 each", got)
	}
	_, release, _ := b.Take(Decode, engines("a"), 0)
	release()
	release() // twice is once
	if n, _ := b.Outstanding(Decode, "a"); n != 0 {
		t.Errorf("%d decode legs outstanding after release", n)
	}
}

func TestDecodeCountsTheEnginesOwnLoadAndAvoidsAFullKVCache(t *testing.T) {
	b := New(time.Minute)
	now := time.Now()
	b.now = func() time.Time { return now }
	b.SetLoad(Decode, "busy", Load{Running: 30, Waiting: 5, At: now})
	defer b.Acquire(Decode, "local", 0)()
	defer b.Acquire(Decode, "local", 0)()
	if e, _ := b.Pick(Decode, engines("busy", "local")); e.EngineID != "local" {
		t.Errorf("picked %s: 35 requests exported beat 2 of this router's", e.EngineID)
	}
	b.SetLoad(Decode, "local", Load{Running: 1, KVUsage: 0.99, At: now})
	if e, _ := b.Pick(Decode, engines("busy", "local")); e.EngineID != "busy" {
		t.Errorf("picked %s: an engine whose KV cache is 99%% full is avoided while another has room", e.EngineID)
	}
	// A load older than the staleness limit no longer counts.
	b.now = func() time.Time { return now.Add(2 * time.Minute) }
	if e, _ := b.Pick(Decode, engines("busy", "local")); e.EngineID != "busy" {
		t.Errorf("picked %s: with stale loads only this router's counts (busy 0, local 2) remain", e.EngineID)
	}
}

func TestEqualEnginesTakeTurns(t *testing.T) {
	b := New(time.Minute)
	seen := map[string]int{}
	for range 6 {
		e, _ := b.Pick(Decode, engines("a", "b", "c"))
		seen[e.EngineID]++
	}
	for _, id := range []string{"a", "b", "c"} {
		if seen[id] != 2 {
			t.Errorf("picks %v: idle equal engines must take turns", seen)
		}
	}
}

func TestParseLoadReadsVLLMsGauges(t *testing.T) {
	l, err := ParseLoad(strings.NewReader(`# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="Qwen/Qwen3-32B"} 3.0
vllm:num_requests_running{engine="1",model_name="Qwen/Qwen3-32B"} 2.0
vllm:num_requests_waiting{engine="0",model_name="a{b}"} 7
vllm:kv_cache_usage_perc{engine="0"} 0.42
vllm:num_requests_running_total 99
vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="0",num_gpu_blocks="29127",num_gpu_blocks_override="None"} 1.0
`))
	if err != nil {
		t.Fatal(err)
	}
	if l.Running != 5 || l.Waiting != 7 || l.KVUsage != 0.42 || l.Blocks != 29127 {
		t.Errorf("load %+v, want running 5 (summed), waiting 7, usage 0.42, 29127 blocks", l)
	}
	if _, err := ParseLoad(strings.NewReader("go_goroutines 12\n")); err == nil {
		t.Error("an exposition without vLLM's gauges must be an error, not an idle engine")
	}
	old, err := ParseLoad(strings.NewReader("vllm:gpu_cache_usage_perc 0.8\n"))
	if err != nil || old.KVUsage != 0.8 {
		t.Errorf("older vLLM's gpu_cache_usage_perc: %+v %v", old, err)
	}
}
