package engineapi

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/kvhandoff/kvhandoff/internal/transferagent/session"
	agentv1 "github.com/kvhandoff/kvhandoff/transferagent/api/v1"
	"github.com/kvhandoff/kvhandoff/transferagent/doorbell"
)

// bell is a session's doorbell (package doorbell has the protocol): the submit ring the
// engine writes its SourceReady reports and Pulls into, drained whenever the engine rings,
// and the events ring the session's events go into instead of the gRPC stream.
//
// Who can reach it: only the process holding the memfd, which the memory socket took
// from a caller that owns the session. What it can do: what its own SourceReady and Pull
// calls could, nothing more; a ring that breaks the layout ends its own session. The
// agent makes both eventfds and hands them to the engine, so their flags are the agent's:
// an EFD_SEMAPHORE eventfd of the engine's would answer each read with 1, and one write
// of 2^64-2 would then cost the agent a core for as long as the session lived.
type bell struct {
	mem    []byte
	submit *doorbell.Ring
	ring   *os.File // the eventfd the engine rings after writing reports
	wake   *os.File // the eventfd the agent rings after writing events
	// efds are ring's and wake's descriptors, to pass: File.Fd would make them blocking.
	efds [2]int

	// live is set once the engine holds the eventfds (the memory socket's answer went
	// out): events go into the ring from then on, on the stream before.
	live atomic.Bool

	mu     sync.Mutex // held while the events ring is written, and to unmap
	events *doorbell.Ring
	closed bool
}

// eventsFullNap is how long an event waits for the engine to free room in its ring
// before trying again; the engine reads the ring at each step.
const eventsFullNap = 200 * time.Microsecond

// attachDoorbell takes a doorbell packet's one fd, the memfd, and returns the eventfds
// that go back in the answer: the one the engine rings, then the one the agent rings.
// The bell goes live once the answer is out (golive(true)), or is dropped (golive(false)).
// The fd passed is kept or closed.
func (srv *Server) attachDoorbell(owner, id string, fds []int) (answer []int, golive func(sent bool), err error) {
	if len(fds) != 1 {
		closeFDs(fds)
		return nil, nil, fmt.Errorf("doorbell: pass the memfd alone, got %d fds (the agent makes the eventfds and "+
			"answers with them; a connector that passes its own is older than this agent)", len(fds))
	}
	b, err := openBell(fds[0])
	if err != nil {
		return nil, nil, err
	}
	s, err := srv.cfg.Sessions.Lookup(id, owner)
	if err != nil {
		b.release()
		return nil, nil, errors.New(status.Convert(err).Message())
	}
	if _, had := srv.bells.LoadOrStore(s, b); had {
		b.release()
		return nil, nil, errors.New("doorbell: the session has one already")
	}
	if s.Ended() {
		srv.bells.Delete(s)
		b.release()
		return nil, nil, errors.New("doorbell: session ended")
	}
	golive = func(sent bool) {
		if !sent {
			srv.bells.Delete(s)
			b.release()
			return
		}
		b.live.Store(true)
		// The session's end closes the ring's eventfd, which ends serveBell, which
		// releases the bell; the bell goes with its session.
		go func() {
			<-s.Stopped()
			b.ring.Close()
			srv.bells.Delete(s)
		}()
		go srv.serveBell(s, b)
	}
	return b.efds[:], golive, nil
}

func openBell(fd int) (*bell, error) {
	defer unix.Close(fd) // a mapping keeps the memory
	_, size, err := session.CheckSealed(fd)
	if err != nil {
		return nil, fmt.Errorf("doorbell: %w", err)
	}
	if size < doorbell.HeaderSize || uint64(size) > doorbell.Size(doorbell.MaxCapacity) {
		return nil, fmt.Errorf("doorbell: a %d-byte memfd; the layout takes %d to %d bytes",
			size, doorbell.Size(doorbell.MinCapacity), doorbell.Size(doorbell.MaxCapacity))
	}
	mem, err := unix.Mmap(fd, 0, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("doorbell: mapping the memfd: %w", err)
	}
	capacity, err := doorbell.Capacity(mem)
	if err != nil {
		unix.Munmap(mem)
		return nil, err
	}
	var efd [2]int
	for i := range efd {
		// Non-blocking: reads wait in the Go runtime's poller, so a Close ends them, and a
		// write to a counter at its limit fails at once instead of waiting for the engine.
		if efd[i], err = unix.Eventfd(0, unix.EFD_CLOEXEC|unix.EFD_NONBLOCK); err != nil {
			closeFDs(efd[:i])
			unix.Munmap(mem)
			return nil, fmt.Errorf("doorbell: eventfd: %w", err)
		}
	}
	return &bell{mem: mem, submit: doorbell.Submit(mem, capacity), events: doorbell.Events(mem, capacity), efds: efd,
		ring: os.NewFile(uintptr(efd[0]), "doorbell"), wake: os.NewFile(uintptr(efd[1]), "doorbell-wake")}, nil
}

// serveBell drains the submit ring each time the engine rings, until the session ends.
func (srv *Server) serveBell(s *session.Session, b *bell) {
	defer b.release()
	buf := make([]byte, 8)
	for {
		if _, err := b.ring.Read(buf); err != nil {
			return // closed: the session ended
		}
		if err := srv.drainBell(s, b); err != nil {
			srv.cfg.Metrics.Refused.WithLabelValues("doorbell", "InvalidArgument").Inc()
			srv.cfg.Log.Warn("ending a session whose doorbell broke", "session", s.ID(), "err", err)
			s.Close(err.Error())
			return
		}
	}
}

// drainBell takes every record in the submit ring and hands them to the session in one
// batch, in order. A record that breaks the layout ends the drain with ErrCorrupt, after
// the records before it were handed over.
func (srv *Server) drainBell(s *session.Session, b *bell) error {
	var reports []session.Report
	_, err := b.submit.Drain(func(kind doorbell.Kind, msg []byte) error {
		var r session.Report
		switch kind {
		case doorbell.KindSourceReady:
			r.Ready = &agentv1.SourceReadyRequest{}
			if err := proto.Unmarshal(msg, r.Ready); err != nil {
				return fmt.Errorf("%w: a record that is no SourceReadyRequest: %v", doorbell.ErrCorrupt, err)
			}
		case doorbell.KindPull:
			r.Pull = &agentv1.PullRequest{}
			if err := proto.Unmarshal(msg, r.Pull); err != nil {
				return fmt.Errorf("%w: a record that is no PullRequest: %v", doorbell.ErrCorrupt, err)
			}
		default:
			return fmt.Errorf("%w: a record of kind %d", doorbell.ErrCorrupt, kind)
		}
		reports = append(reports, r)
		return nil
	})
	if len(reports) > 0 {
		srv.cfg.Metrics.BellRecords.WithLabelValues("report").Add(float64(len(reports)))
		s.Reports(reports)
	}
	return err
}

// putEvent writes one event into the events ring, waiting while it is full for the
// engine to read, until stop or gone closes (the session ended, or its engine's stream
// did: an engine that exits with its ring full must not keep its session alive).
// ErrCorrupt means the engine broke the ring.
func (b *bell) putEvent(ev *agentv1.Event, stop, gone <-chan struct{}) error {
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
		if err == nil {
			b.ringWake()
		}
		b.mu.Unlock()
		switch {
		case err == nil:
			return nil
		case !errors.Is(err, doorbell.ErrFull):
			return err
		}
		select {
		case <-stop:
			return errors.New("doorbell: session ended")
		case <-gone:
			return errors.New("doorbell: the engine's event stream closed")
		case <-time.After(eventsFullNap):
		}
	}
}

// ringWake adds one to the wake eventfd (b.mu held) without ever waiting: when the
// engine let the counter reach its limit the write fails with EAGAIN, and the counter
// still wakes the engine.
func (b *bell) ringWake() {
	rc, err := b.wake.SyscallConn()
	if err != nil {
		return
	}
	one := binary.NativeEndian.AppendUint64(nil, 1)
	_ = rc.Write(func(fd uintptr) bool {
		_, _ = unix.Write(int(fd), one)
		return true // done, whatever the write said: no wait in the poller
	})
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
	b.wake.Close()
	unix.Munmap(b.mem)
}
