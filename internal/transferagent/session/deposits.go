package session

import (
	"errors"
	"fmt"
	"os"
)

// Memfds an engine passed over the memory socket wait in its session, by handle, until a
// RegisterRegion names them.

// maxDeposits bounds the fds a session may hold unclaimed: a rank registers its regions
// from one memfd or a few.
const maxDeposits = 64

// Deposit keeps a passed memfd until a RegisterRegion claims it or the session ends.
func (s *Session) Deposit(f *os.File) (uint64, error) {
	s.fdMu.Lock()
	defer s.fdMu.Unlock()
	if s.fds == nil {
		f.Close()
		return 0, errors.New("session: ended")
	}
	if len(s.fds) >= maxDeposits {
		f.Close()
		return 0, fmt.Errorf("session: %d memfds passed and not yet registered; register them first", maxDeposits)
	}
	s.nextFD++
	s.fds[s.nextFD] = f
	return s.nextFD, nil
}

// claim takes the memfd a RegisterRegion names.
func (s *Session) claim(h uint64) *os.File {
	s.fdMu.Lock()
	defer s.fdMu.Unlock()
	f := s.fds[h]
	delete(s.fds, h)
	return f
}

// dropDeposits closes every unclaimed memfd; later deposits are refused.
func (s *Session) dropDeposits() {
	s.fdMu.Lock()
	defer s.fdMu.Unlock()
	for _, f := range s.fds {
		f.Close()
	}
	s.fds = nil
}
