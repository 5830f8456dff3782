package protocol

import (
	"encoding/json"
	"strings"
	"testing"
)

// BenchmarkLegs16k is the router's per-request work on a 16k-token prompt of token ids:
// parse, count tokens, build both push legs.
func BenchmarkLegs16k(b *testing.B) {
	ids := make([]int, 16384)
	for i := range ids {
		ids[i] = i * 7 % 150000
	}
	data, _ := json.Marshal(map[string]any{"model": "m", "prompt": ids, "max_tokens": 4, "stream": true})
	b.SetBytes(int64(len(data)))
	for b.Loop() {
		body, err := Parse(data)
		if err != nil {
			b.Fatal(err)
		}
		_ = PromptTokens(body)
		_ = PrefillLeg(body, "xfer-1").Marshal()
		_ = PushDecodeLeg(body, Prefill{EngineID: "p", Host: "h", Port: 1, TP: 8}, "r", "xfer-1").Marshal()
	}
}

// BenchmarkPromptTokensNested counts a 1 MiB prompt of arrays nested 9,990 deep: linear
// in its size (a count that rescanned each level took 3.7 s here).
func BenchmarkPromptTokensNested(b *testing.B) {
	const depth = 9990
	body := []byte(`{"prompt":` + strings.Repeat("[", depth) + `"` + strings.Repeat("x", 1<<20-2*depth) + `"` + strings.Repeat("]", depth) + `}`)
	parsed, err := Parse(body)
	if err != nil {
		b.Fatal(err)
	}
	b.SetBytes(int64(len(body)))
	for b.Loop() {
		PromptTokens(parsed)
	}
}
