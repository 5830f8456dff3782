package simengine

import (
	"math"
	"time"
)

// prefillCurve is the whole-model prefill time of a Qwen3-32B-shaped model at TP1, as
// measured on one H200 (bf16, PyTorch SDPA causal attention; docs/design.md#the-prefill-timing-model): 64 layers
// at 2.8, 6.1, 13.9 and 31.7 ms per layer. Attention makes it super-linear in tokens.
var prefillCurve = []struct {
	tokens int
	d      time.Duration
}{
	{2048, 180 * time.Millisecond},
	{4096, 389 * time.Millisecond},
	{8192, 892 * time.Millisecond},
	{16384, 2027 * time.Millisecond},
}

// allReduceAt16k is the tensor-parallel all-reduce cost of a 16k-token prefill at TP8.
const allReduceAt16k = 275 * time.Millisecond

// Prefill models one prefill engine's compute time.
type Prefill struct {
	// TP is the engine's tensor-parallel size: compute divides by it, all-reduce adds.
	TP int
	// Speedup divides the measured bf16 time (FP8 is about 2×); 0 means 1.
	Speedup float64
}

// Time is how long the engine takes to prefill tokens.
func (p Prefill) Time(tokens int) time.Duration {
	tp1 := interpolate(tokens)
	tp := max(p.TP, 1)
	d := tp1 / time.Duration(tp)
	if tp > 1 {
		// All-reduce traffic grows with tokens and with the share each rank exchanges.
		d += time.Duration(float64(allReduceAt16k) * float64(tokens) / 16384 * float64(tp-1) / 7)
	}
	if p.Speedup > 0 {
		d = time.Duration(float64(d) / p.Speedup)
	}
	return d
}

// interpolate is piecewise linear over the curve: proportional below its first point,
// extended along its last segment above its last.
func interpolate(tokens int) time.Duration {
	c := prefillCurve
	if tokens <= c[0].tokens {
		return c[0].d * time.Duration(tokens) / time.Duration(c[0].tokens)
	}
	i := 1
	for i < len(c)-1 && tokens > c[i].tokens {
		i++
	}
	a, b := c[i-1], c[i]
	f := float64(tokens-a.tokens) / float64(b.tokens-a.tokens)
	return a.d + time.Duration(f*float64(b.d-a.d))
}

// SpeedupFor is the speedup at which engines prefill qps requests of tokens each at the
// given utilisation, so that a benchmark measures the handoff, not a queue (docs/design.md#the-prefill-timing-model).
// For one TP8 engine at 8 QPS of 16k tokens and 65% it is about 6.5: with the all-reduce
// included, bf16 prefill of 16k tokens takes 528 ms at TP8.
func SpeedupFor(tp, engines int, qps float64, tokens int, utilisation float64) float64 {
	busy := Prefill{TP: tp}.Time(tokens).Seconds() * qps / float64(engines)
	return math.Max(busy/utilisation, 1e-9)
}
