package engineapi

import (
	"errors"
	"fmt"
	"os"
	"strconv"
	"sync"
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
func (srv *Server) attachDoorbell(owner, id string, fds []int) error {
	if len(fds) != 2 && len(fds) != 3 {
		closeFDs(fds)
		return fmt.Errorf("doorbell: pass the memfd and one or two eventfds, got %d fds", len(fds))
	}
	b, err := openBell(fds)
	if err != nil {
		return err
	}
	s, err := srv.cfg.Sessions.Lookup(id, owner)
	if err != nil {
		b.release()
		return errors.New(status.Convert(err).Message())
	}
	if _, had := srv.bells.LoadOrStore(s, b); had {
		b.release()
		return errors.New("doorbell: the session has one already")
	}
	if s.Ended() {
		srv.bells.Delete(s)
		b.release()
		return errors.New("doorbell: session ended")
	}
	// The session's end closes the engine's eventfd, which ends serveBell, which
	// releases the bell; the bell goes with its session.
	go func() {
		<-s.Stopped()
		b.ring.Close()
		srv.bells.Delete(s)
	}()
	go srv.serveBell(s, b)
	return nil
}

func openBell(fds []int) (*bell, error) {
	fail := func(err error) (*bell, error) {
		closeFDs(fds)
		return nil, err
	}
	_, size, err := session.CheckSealed(fds[0])
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
