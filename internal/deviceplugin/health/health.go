// Package health decides whether a device is healthy. A failed check makes it unhealthy
// at once; it turns healthy again only after every check has passed for RecoverAfter —
// stock device plugins never recover a device, and users restart them to get GPUs back
// after a transient fault. A critical XID latches a GPU unhealthy until the driver
// (NVML) says it is usable again, and only then does its quiet period start: a GPU that
// fell off the bus keeps its device node, so the node check alone would bring it back.
package health

import (
	"sync"
	"time"
)

// Tracker remembers when each device last failed.
type Tracker struct {
	// RecoverAfter is how long a device must pass every check before it is healthy again.
	RecoverAfter time.Duration
	// Now is the clock; tests set it.
	Now func() time.Time

	mu      sync.Mutex
	lastBad map[string]time.Time
	latched map[string]bool
}

// NewTracker returns a tracker on the wall clock.
func NewTracker(recoverAfter time.Duration) *Tracker {
	return &Tracker{RecoverAfter: recoverAfter, Now: time.Now, lastBad: map[string]time.Time{}, latched: map[string]bool{}}
}

// Latch marks a device failed until Unlatch, however long its checks pass: after a
// critical error only the driver can say the device is usable again.
func (t *Tracker) Latch(id string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.latched[id] = true
	t.lastBad[id] = t.Now()
}

// Latched reports whether a device waits for Unlatch.
func (t *Tracker) Latched(id string) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.latched[id]
}

// Unlatch lets a latched device recover: its quiet period starts now.
func (t *Tracker) Unlatch(id string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	delete(t.latched, id)
	t.lastBad[id] = t.Now()
}

// Fail records a failed check or critical event for a device.
func (t *Tracker) Fail(id string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.lastBad[id] = t.Now()
}

// Healthy reports whether the device has not failed within RecoverAfter.
func (t *Tracker) Healthy(id string) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	last, ok := t.lastBad[id]
	return !t.latched[id] && (!ok || t.Now().Sub(last) >= t.RecoverAfter)
}
