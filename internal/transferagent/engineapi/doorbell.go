package engineapi

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
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
// calls could, nothing more; a ring that breaks the layout ends its own session.
//
// The bells themselves are two Unix socket pairs, one a direction, made by the agent: the
// engine gets one end of each and the agent keeps the other, a file description of its
// own. Nothing the engine does to its ends reaches the agent's: it cannot make them
// blocking (an eventfd passed to the engine shared its O_NONBLOCK, and an engine that
// cleared it wedged the agent in a write under the bell's lock, or left a thread, two fds
// and two goroutines behind each closed session), nor make a read answer more than once.
// The agent's ends are non-blocking and read in the Go runtime's poller, so a Close ends
// a read at once; a wake the engine does not read fails at once (EAGAIN), and the agent's
// wake end is shut for reading, so the engine cannot fill it either.
type bell struct {
	mem    []byte
	submit *doorbell.Ring
	ring   *os.File // the agent's end of the pair the engine rings after writing reports
	wake   *os.File // the agent's end of the pair it rings after writing events
	// engine are the engine's ends, ring's then wake's, to pass; closed by sent.
	engine     [2]int
	engineOnce sync.Once

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

// attachDoorbell takes a doorbell packet's one fd, the memfd, and returns the engine's
// ends of the bells that go back in the answer: the one the engine rings, then the one
// the agent rings. The bell goes live once the answer is out (golive(true)), or is
// dropped (golive(false)). The fd passed is kept or closed; the caller closes the engine's
// ends once sent.
func (srv *Server) attachDoorbell(owner, id string, fds []int) (answer []int, golive func(sent bool), err error) {
	if len(fds) != 1 {
		closeFDs(fds)
		return nil, nil, fmt.Errorf("doorbell: pass the memfd alone, got %d fds (the agent makes the bells and "+
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
		b.sent()
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
	return b.engine[:], golive, nil
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
	ring, wake, engine, err := bellPairs()
	if err != nil {
		unix.Munmap(mem)
		return nil, err
	}
	return &bell{mem: mem, submit: doorbell.Submit(mem, capacity), events: doorbell.Events(mem, capacity), engine: engine,
		ring: os.NewFile(uintptr(ring), "doorbell"), wake: os.NewFile(uintptr(wake), "doorbell-wake")}, nil
}

// bellPairs makes the two socket pairs and returns the agent's ends (ring: read only;
// wake: written only; both non-blocking) and the engine's (blocking, the engine's to set).
func bellPairs() (ring, wake int, engine [2]int, err error) {
	var fds [4]int
	for i := 0; i < 4; i += 2 {
		pair, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			closeFDs(fds[:i])
			return 0, 0, engine, fmt.Errorf("doorbell: socketpair: %w", err)
		}
		fds[i], fds[i+1] = pair[0], pair[1]
	}
	ring, wake, engine = fds[0], fds[2], [2]int{fds[1], fds[3]}
	for _, c := range []struct{ fd, how int }{{ring, unix.SHUT_WR}, {wake, unix.SHUT_RD}} {
		if err = unix.SetNonblock(c.fd, true); err == nil {
			err = unix.Shutdown(c.fd, c.how)
		}
		if err != nil {
			closeFDs(fds[:])
			return 0, 0, engine, fmt.Errorf("doorbell: %w", err)
		}
	}
	return ring, wake, engine, nil
}

// serveBell drains the submit ring each time the engine rings, until the session ends
// or the engine closes its end of the bell (which ends the session: its reports could no
// longer reach the agent).
func (srv *Server) serveBell(s *session.Session, b *bell) {
	defer b.release()
	buf := make([]byte, 4096) // rings since the last read, taken in one
	for {
		if _, err := b.ring.Read(buf); errors.Is(err, io.EOF) {
			s.Close("the engine closed its doorbell")
			return
		} else if err != nil {
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

// ringWake rings the engine (b.mu held) without ever waiting: when the engine has left
// its end unread the send fails with EAGAIN, and what it left unread still wakes it; when
// it closed its end, with EPIPE (and no SIGPIPE).
func (b *bell) ringWake() {
	rc, err := b.wake.SyscallConn()
	if err != nil {
		return
	}
	_ = rc.Write(func(fd uintptr) bool {
		_ = unix.Sendto(int(fd), wakeRing, unix.MSG_DONTWAIT|unix.MSG_NOSIGNAL, nil)
		return true // done, whatever the send said: no wait in the poller
	})
}

// wakeRing is what a ring writes: 8 bytes of 1, as an eventfd write of 1, which is what
// connectors before the socket pairs read.
var wakeRing = binary.NativeEndian.AppendUint64(nil, 1)

// sent closes the agent's copies of the engine's ends, once they went out (or will not).
func (b *bell) sent() { b.engineOnce.Do(func() { closeFDs(b.engine[:]) }) }

// release unmaps the rings once nothing can write them.
func (b *bell) release() {
	b.sent()
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
