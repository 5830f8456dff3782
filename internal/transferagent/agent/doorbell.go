package agent

import (
	"errors"
	"fmt"
	"os"
	"strconv"
	"sync"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	agentv1 "github.com/kvhandoff/kvhandoff/transferagent/api/v1"
	"github.com/kvhandoff/kvhandoff/transferagent/doorbell"
)

// bell is a session's doorbell (package doorbell has the protocol): the submit ring the
// engine writes its SourceReady reports and Pulls into, drained whenever the engine rings,
// and the events ring the session's events go into instead of the gRPC stream.
//
// Who can reach it: only the process holding the memfd, which the memory socket took
// from a caller that owns the session. What it can do: what its own SourceReady and Pull
// calls could, nothing more; a ring that breaks the layout ends its own session.
type bell struct {
	mem    []byte
	submit *doorbell.Ring
	ring   *os.File // the eventfd the engine rings after writing reports
	wake   *os.File // the eventfd the agent rings after writing events; nil: the engine polls

	mu     sync.Mutex // held while the events ring is written, and to unmap
	events *doorbell.Ring
	closed bool
}

// eventsFullNap is how long an event waits for the engine to free room in its ring
// before trying again; the engine reads the ring at each step.
const eventsFullNap = 200 * time.Microsecond

// attachDoorbell takes a doorbell packet's fds: the memfd, the eventfd the engine rings
// and, optionally, one the agent rings. Every fd is either kept or closed.
func (a *Agent) attachDoorbell(owner, id string, fds []int) error {
	if len(fds) != 2 && len(fds) != 3 {
		closeFDs(fds)
		return fmt.Errorf("doorbell: pass the memfd and one or two eventfds, got %d fds", len(fds))
	}
	b, err := openBell(fds)
	if err != nil {
		return err
	}
	s, err := a.session(id, owner)
	if err != nil {
		b.release()
		return errors.New(status.Convert(err).Message())
	}
	if !s.bell.CompareAndSwap(nil, b) {
		b.release()
		return errors.New("doorbell: the session has one already")
	}
	if s.ended() {
		b.release() // the teardown may have come first: nothing else will
		return errors.New("doorbell: session ended")
	}
	go s.serveBell(b)
	return nil
}

func openBell(fds []int) (*bell, error) {
	fail := func(err error) (*bell, error) {
		closeFDs(fds)
		return nil, err
	}
	_, size, err := checkSealed(fds[0])
	if err != nil {
		return fail(fmt.Errorf("doorbell: %w", err))
	}
	if size < doorbell.HeaderSize || uint64(size) > doorbell.Size(doorbell.MaxCapacity) {
		return fail(fmt.Errorf("doorbell: a %d-byte memfd; the layout takes %d to %d bytes",
			size, doorbell.Size(doorbell.MinCapacity), doorbell.Size(doorbell.MaxCapacity)))
	}
	for _, fd := range fds[1:] {
		if err := checkEventfd(fd); err != nil {
			return fail(err)
		}
	}
	mem, err := unix.Mmap(fds[0], 0, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return fail(fmt.Errorf("doorbell: mapping the memfd: %w", err))
	}
	unix.Close(fds[0]) // the mapping keeps the memory
	capacity, err := doorbell.Capacity(mem)
	if err != nil {
		unix.Munmap(mem)
		closeFDs(fds[1:])
		return nil, err
	}
	b := &bell{mem: mem, submit: doorbell.Submit(mem, capacity), events: doorbell.Events(mem, capacity)}
	// Non-blocking, so that reads wait in the Go runtime's poller and a Close ends them.
	unix.SetNonblock(fds[1], true)
	b.ring = os.NewFile(uintptr(fds[1]), "doorbell")
	if len(fds) == 3 {
		unix.SetNonblock(fds[2], true)
		b.wake = os.NewFile(uintptr(fds[2]), "doorbell-wake")
	}
	return b, nil
}

// checkEventfd refuses an fd that is not an eventfd: a pipe or socket in its place could
// block the agent's writes or feed its reads.
func checkEventfd(fd int) error {
	target, err := os.Readlink("/proc/self/fd/" + strconv.Itoa(fd))
	if err != nil {
		return fmt.Errorf("doorbell: %w", err)
	}
	if target != "anon_inode:[eventfd]" {
		return fmt.Errorf("doorbell: fd %s is not an eventfd", target)
	}
	return nil
}

// serveBell drains the submit ring each time the engine rings, until the session ends.
func (s *session) serveBell(b *bell) {
	defer b.release()
	buf := make([]byte, 8)
	for {
		if _, err := b.ring.Read(buf); err != nil {
			return // closed: the session ended
		}
		if err := s.drainBell(b); err != nil {
			s.n.metrics.refused.WithLabelValues("doorbell", "InvalidArgument").Inc()
			s.n.log.Warn("ending a session whose doorbell broke", "engine", s.key, "err", err)
			s.close(err.Error())
			return
		}
	}
}

// drainBell takes every record in the submit ring and hands them to the pump in one
// command. A record the agent refuses is answered with a FAILED event for its request
// (and attempt), as the engine's call would have been with an error.
func (s *session) drainBell(b *bell) error {
	var calls []bellCall
	_, err := b.submit.Drain(func(kind doorbell.Kind, msg []byte) error {
		var c bellCall
		switch kind {
		case doorbell.KindSourceReady:
			c.ready = &agentv1.SourceReadyRequest{}
			err := proto.Unmarshal(msg, c.ready)
			if err != nil {
				return fmt.Errorf("%w: a record that is no SourceReadyRequest: %v", doorbell.ErrCorrupt, err)
			}
		case doorbell.KindPull:
			c.pull = &agentv1.PullRequest{}
			if err := proto.Unmarshal(msg, c.pull); err != nil {
				return fmt.Errorf("%w: a record that is no PullRequest: %v", doorbell.ErrCorrupt, err)
			}
		default:
			return fmt.Errorf("%w: a record of kind %d", doorbell.ErrCorrupt, kind)
		}
		calls = append(calls, c)
		return nil
	})
	if len(calls) > 0 {
		s.n.metrics.bellRecords.WithLabelValues("report").Add(float64(len(calls)))
		s.post(func() {
			for _, c := range calls {
				if err := c.run(s); err != nil {
					s.n.metrics.refused.WithLabelValues("doorbell", status.Code(err).String()).Inc()
					s.emit(&agentv1.Event{Type: agentv1.Event_FAILED, RequestId: c.request(), Attempt: c.attempt(), Reason: status.Convert(err).Message()})
				}
			}
		})
	}
	return err
}

// bellCall is one record of the submit ring: a SourceReady or a Pull.
type bellCall struct {
	ready *agentv1.SourceReadyRequest
	pull  *agentv1.PullRequest
}

func (c bellCall) request() string {
	if c.pull != nil {
		return c.pull.RequestId
	}
	return c.ready.RequestId
}

func (c bellCall) attempt() uint64 {
	if c.pull != nil {
		return c.pull.Attempt
	}
	return 0
}

// run does on the pump what the RPC of the same name does, with the same checks.
func (c bellCall) run(s *session) error {
	if c.pull != nil {
		if s.role != agentv1.Role_ROLE_DECODE || s.mode != agentv1.Mode_MODE_PULL {
			return status.Errorf(codes.FailedPrecondition, "Pull: not allowed for a %s engine in %s", s.role, s.mode)
		}
		if err := checkPull(c.pull, s.rank); err != nil {
			return err
		}
		return s.decode().pull(c.pull)
	}
	if s.role != agentv1.Role_ROLE_PREFILL {
		return status.Errorf(codes.FailedPrecondition, "SourceReady: not allowed for a %s engine in %s", s.role, s.mode)
	}
	if err := checkRequest(c.ready.RequestId, "block_ids", c.ready.BlockIds); err != nil {
		return err
	}
	return s.prefill().sourceReady(c.ready)
}

// putEvent writes one event into the events ring, waiting while it is full for the
// engine to read, until stop closes. ErrCorrupt means the engine broke the ring.
func (b *bell) putEvent(ev *agentv1.Event, stop <-chan struct{}) error {
	msg, err := proto.Marshal(ev)
	if err != nil {
		return err
	}
	for {
		b.mu.Lock()
		if b.closed {
			b.mu.Unlock()
			return errors.New("doorbell: closed")
		}
		err := b.events.Put(doorbell.KindEvent, msg)
		b.mu.Unlock()
		switch {
		case err == nil:
			if b.wake != nil {
				var one [8]byte
				one[0] = 1
				b.wake.Write(one[:]) // a counter at its limit already wakes the engine
			}
			return nil
		case !errors.Is(err, doorbell.ErrFull):
			return err
		}
		select {
		case <-stop:
			return errors.New("doorbell: session ended")
		case <-time.After(eventsFullNap):
		}
	}
}

// closeBell ends the session's doorbell: serveBell returns and releases it.
func (s *session) closeBell() {
	if b := s.bell.Load(); b != nil {
		b.ring.Close()
	}
}

// release unmaps the rings once nothing can write them.
func (b *bell) release() {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return
	}
	b.closed = true
	b.ring.Close()
	if b.wake != nil {
		b.wake.Close()
	}
	unix.Munmap(b.mem)
}
