package nvml

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	gonvml "github.com/NVIDIA/go-nvml/pkg/nvml"
)

// failingSet fails every wait as a GPU that fell off the bus does, and tells the test of
// the second wait.
type failingSet struct {
	waits atomic.Int32
	again chan string
}

func (f *failingSet) Wait(uint32) (gonvml.EventData, gonvml.Return) {
	if f.waits.Add(1) == 2 {
		f.again <- "waited again"
	}
	return gonvml.EventData{}, gonvml.ERROR_GPU_IS_LOST
}

// A failed wait reaches the monitor (which then asks NVML about every GPU), and the pump
// backs off before waiting again: it used to skip the error and wait again at once,
// spinning on GPU_IS_LOST while every GPU stayed healthy.
func TestAFailedEventWaitIsReportedAndBackedOff(t *testing.T) {
	set := &failingSet{again: make(chan string, 1)}
	ctx, cancel := context.WithCancel(context.Background())
	out := make(chan Event)
	next := make(chan string, 1)
	after := func(d time.Duration) <-chan time.Time {
		next <- "backed off " + d.String()
		return nil // the test ends before the backoff would
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		pump(ctx, set, out, after, func(r gonvml.Return) string { return "GPU is lost" })
	}()
	e := <-out
	if e.UUID != "" || e.Err != "GPU is lost" {
		t.Fatalf("event %+v, want one without a GPU saying why the wait failed", e)
	}
	select {
	case got := <-next:
		if got != "backed off "+waitBackoff.String() {
			t.Errorf("%s, want a backoff of %s", got, waitBackoff)
		}
	case got := <-set.again:
		t.Errorf("the pump %s without backing off", got)
	case <-out:
		t.Error("the pump reported a second failed wait without backing off")
	}
	cancel()
	<-done
}
