package protocol

import (
	"encoding/json"
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
