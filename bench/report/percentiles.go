package report

import (
	"math"
	"slices"
)

// Percentiles are in milliseconds.
type Percentiles struct {
	P50 float64 `json:"p50"`
	P90 float64 `json:"p90"`
	P99 float64 `json:"p99"`
}

// Of returns nearest-rank percentiles of ms values.
func Of(v []float64) Percentiles {
	if len(v) == 0 {
		return Percentiles{}
	}
	s := slices.Clone(v)
	slices.Sort(s)
	at := func(p float64) float64 {
		i := int(math.Ceil(p*float64(len(s)))) - 1
		return Round(s[max(i, 0)])
	}
	return Percentiles{P50: at(0.50), P90: at(0.90), P99: at(0.99)}
}

// Round keeps two decimals.
func Round(v float64) float64 { return math.Round(v*100) / 100 }
