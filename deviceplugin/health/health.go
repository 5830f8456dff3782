// Package health decides whether a device is healthy. A failed check or a critical
// event makes it unhealthy at once; it turns healthy again only after every check has
// passed for RecoverAfter — stock device plugins never recover a device, and users
// restart them to get GPUs back after a transient fault.
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
}

// NewTracker returns a tracker on the wall clock.
func NewTracker(recoverAfter time.Duration) *Tracker {
	return &Tracker{RecoverAfter: recoverAfter, Now: time.Now, lastBad: map[string]time.Time{}}
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
	return !ok || t.Now().Sub(last) >= t.RecoverAfter
}
