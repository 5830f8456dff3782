package peercred

import "sync"

// Slots counts what each owner holds of something (connections, streams) against a
// per-owner limit, so one caller exhausting its share leaves every other caller theirs.
type Slots struct {
	limit int
	mu    sync.Mutex
	held  map[string]int
}

// NewSlots allows each owner limit at a time.
func NewSlots(limit int) *Slots { return &Slots{limit: limit, held: map[string]int{}} }

// Limit is what each owner may hold.
func (s *Slots) Limit() int { return s.limit }

// Take takes one of owner's slots; release gives it back (once, whatever calls it).
func (s *Slots) Take(owner string) (release func(), ok bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.held[owner] >= s.limit {
		return nil, false
	}
	s.held[owner]++
	var once sync.Once
	return func() {
		once.Do(func() {
			s.mu.Lock()
			defer s.mu.Unlock()
			if s.held[owner]--; s.held[owner] == 0 {
				delete(s.held, owner)
			}
		})
	}, true
}
