package session

import (
	"errors"
	"fmt"
	"os"

	"github.com/kvhandoff/kvhandoff/internal/transferagent/cudaipc"
)

// Memfds an engine passed over the memory socket wait in its session, by handle, until a
// RegisterRegion names them; GPU allocations passed there are mapped at once and held,
// by handle, for the regions that name them, until the session ends.

// maxDeposits bounds the memfds a session may hold unclaimed, and the GPU allocations it
// may pass: a rank registers its regions from one memfd or a few, or from an allocation
// per layer (vLLM's GPU workers make one per KV cache tensor).
const maxDeposits = 64

// Deposit keeps a passed memfd until a RegisterRegion claims it or the session ends.
func (s *Session) Deposit(f *os.File) (uint64, error) {
	s.fdMu.Lock()
	defer s.fdMu.Unlock()
	if s.fds == nil {
		f.Close()
		return 0, errors.New("session: ended")
	}
	if len(s.fds)+len(s.passed) >= maxDeposits {
		f.Close()
		return 0, fmt.Errorf("session: %d memfds and GPU allocations passed, memfds not yet registered; register them first", maxDeposits)
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

// passedGPU is a GPU allocation an engine passed: its key among the agent's, and the GPU
// that holds it.
type passedGPU struct {
	key     cudaipc.Key
	ordinal int
}

// PassGPU maps size bytes of the GPU allocation fd passes (the caller keeps fd) and keeps
// it until the session ends, for the regions that name the handle returned.
func (s *Session) PassGPU(fd int, size uint64) (uint64, error) {
	s.fdMu.Lock()
	defer s.fdMu.Unlock()
	if s.fds == nil {
		return 0, errors.New("session: ended")
	}
	if len(s.fds)+len(s.passed) >= maxDeposits {
		return 0, fmt.Errorf("session: %d memfds and GPU allocations passed already", maxDeposits)
	}
	k, ordinal, err := s.n.gpus.Pass(fd, size)
	if err != nil {
		return 0, err
	}
	s.nextFD++
	s.passed[s.nextFD] = passedGPU{key: k, ordinal: ordinal}
	return s.nextFD, nil
}

// passedAllocation is the GPU allocation handle names.
func (s *Session) passedAllocation(h uint64) (passedGPU, bool) {
	s.fdMu.Lock()
	defer s.fdMu.Unlock()
	p, ok := s.passed[h]
	return p, ok
}

// dropDeposits closes every unclaimed memfd and lets go of the passed GPU allocations
// (their regions hold them until closeGPU); later deposits are refused.
func (s *Session) dropDeposits() {
	s.fdMu.Lock()
	defer s.fdMu.Unlock()
	for _, f := range s.fds {
		f.Close()
	}
	for _, p := range s.passed {
		s.n.gpus.Close(p.key)
	}
	s.fds, s.passed = nil, nil
}
