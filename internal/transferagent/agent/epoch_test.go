package agent

import (
	"testing"
	"time"
)

func TestEpochsIncreaseWithTimeAndDoNotWrap(t *testing.T) {
	var last uint64
	for _, year := range []int{2026, 2032, 2040, 2100, 3000} {
		at := time.Date(year, 1, 1, 0, 0, 0, 0, time.UTC)
		e := epochAt(at, 0xffff)
		if e <= last {
			t.Errorf("the epoch of %d (%d) is not above the one before (%d)", year, e, last)
		}
		if lo := epochAt(at, 0); lo>>16 != uint64(at.UnixMilli()) {
			t.Errorf("%d: the time in the epoch is %d, want %d", year, lo>>16, at.UnixMilli())
		}
		last = e
	}
	// A restart a second later is above every session epoch of the run before it.
	start := time.Date(2030, 6, 1, 0, 0, 0, 0, time.UTC)
	if before, after := epochAt(start, 0xffff)+1_000_000, epochAt(start.Add(time.Second), 0); after <= before {
		t.Errorf("a restart 1 s later (%d) is not above a run's millionth session (%d)", after, before)
	}
}
