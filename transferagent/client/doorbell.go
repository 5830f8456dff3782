package client

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"sync"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"

	agentv1 "github.com/kvhandoff/kvhandoff/transferagent/api/v1"
	"github.com/kvhandoff/kvhandoff/transferagent/doorbell"
)

// bell is the engine's side of its doorbell.
type bell struct {
	mem    []byte
	ring   *os.File   // rung after each report
	wake   *os.File   // rung by the agent after events
	mu     sync.Mutex // held while the submit ring is written, and to unmap
	closed bool
	submit *doorbell.Ring
	events *doorbell.Ring
	done   chan struct{}
}

// fullNap is how long a report waits for the agent to free room in a full ring.
const fullNap = 50 * time.Microsecond

// UseDoorbell moves the session's SourceReady reports, its Pulls and its events onto a
// doorbell (package doorbell): shared rings the agent drains when rung, instead of an RPC
// per call and a stream message per event. Call it once, before the first request.
func (e *Engine) UseDoorbell() error {
	size := int(doorbell.Size(doorbell.DefaultCapacity))
	fd, mem, err := NewMemory("kvhandoff-doorbell", size)
	if err != nil {
		return fmt.Errorf("doorbell: %w", err)
	}
	defer unix.Close(fd)
	if err := doorbell.Init(mem, doorbell.DefaultCapacity); err != nil {
		unix.Munmap(mem)
		return err
	}
	efds, err := passDoorbell(agentv1.MemorySocket(e.c.socket), e.Session, fd)
	if err != nil {
		unix.Munmap(mem)
		return err
	}
	b := &bell{
		mem: mem, ring: os.NewFile(uintptr(efds[0]), "doorbell"), wake: os.NewFile(uintptr(efds[1]), "doorbell-wake"),
		submit: doorbell.Submit(mem, doorbell.DefaultCapacity), events: doorbell.Events(mem, doorbell.DefaultCapacity),
		done: make(chan struct{}),
	}
	e.bell = b
	go e.readBell(b)
	return nil
}

// passDoorbell passes the doorbell's memfd and returns the bells the agent answers with
// (its ends of two socket pairs): the one the engine rings, and the one the agent rings.
func passDoorbell(socket, session string, memfd int) ([2]int, error) {
	var efds [2]int
	c, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: socket, Net: "unixpacket"})
	if err != nil {
		return efds, fmt.Errorf("memory socket: %w", err)
	}
	defer c.Close()
	if _, _, err := c.WriteMsgUnix([]byte(agentv1.DoorbellPrefix+session), unix.UnixRights(memfd), nil); err != nil {
		return efds, fmt.Errorf("memory socket: %w", err)
	}
	buf, oob := make([]byte, 512), make([]byte, unix.CmsgSpace(4*len(efds)))
	n, oobn, _, _, err := c.ReadMsgUnix(buf, oob)
	if err != nil {
		return efds, fmt.Errorf("memory socket: %w", err)
	}
	var fds []int
	if msgs, err := unix.ParseSocketControlMessage(oob[:oobn]); err == nil {
		for _, m := range msgs {
			got, _ := unix.ParseUnixRights(&m)
			fds = append(fds, got...)
		}
	}
	if _, err := agentv1.ParseMemoryAnswer(buf[:n]); err != nil {
		closeAll(fds)
		return efds, err
	}
	if len(fds) != len(efds) {
		closeAll(fds)
		return efds, fmt.Errorf("memory socket: the doorbell's answer carried %d fds, not the two bells", len(fds))
	}
	for i, fd := range fds {
		unix.CloseOnExec(fd)
		unix.SetNonblock(fd, true) // reads wait in the Go runtime's poller, so a Close ends them
		efds[i] = fd
	}
	return efds, nil
}

func closeAll(fds []int) {
	for _, fd := range fds {
		unix.Close(fd)
	}
}

// readBell moves the events the agent writes into the events channel, until the
// session's stream ends (stopBell).
func (e *Engine) readBell(b *bell) {
	defer close(b.done)
	buf := make([]byte, 4096) // every ring since the last read, taken in one
	for {
		_, rerr := b.wake.Read(buf)
		var evs []*agentv1.Event
		_, err := b.events.Drain(func(_ doorbell.Kind, msg []byte) error {
			ev := &agentv1.Event{}
			if err := proto.Unmarshal(msg, ev); err != nil {
				return err
			}
			evs = append(evs, ev)
			return nil
		})
		for _, ev := range evs {
			e.events <- ev
		}
		if err != nil {
			e.fail(fmt.Errorf("doorbell events: %w", err))
			return
		}
		if rerr != nil {
			return // closed by stopBell, after a last drain
		}
	}
}

// stopBell ends readBell; the events channel may close after it returns.
func (e *Engine) stopBell() {
	if b := e.bell; b != nil {
		b.wake.Close()
		<-b.done
		b.mu.Lock()
		defer b.mu.Unlock()
		b.closed = true
		b.ring.Close()
		unix.Munmap(b.mem)
	}
}

// submit writes one record (a SourceReady or a Pull) into the submit ring and rings the
// agent: false when the session has no doorbell, or the record is too large for the ring
// (it then goes by RPC; a request's parts all name the same blocks, so they all go the
// same way).
func (e *Engine) submit(ctx context.Context, kind doorbell.Kind, m proto.Message) (bool, error) {
	b := e.bell
	if b == nil {
		return false, nil
	}
	msg, err := proto.Marshal(m)
	if err != nil || len(msg) > doorbell.MaxRecord {
		return false, err
	}
	for {
		b.mu.Lock()
		if b.closed {
			b.mu.Unlock()
			return true, errors.New("doorbell: the session ended")
		}
		err := b.submit.Put(kind, msg)
		b.mu.Unlock()
		if err == nil {
			break
		}
		if !errors.Is(err, doorbell.ErrFull) {
			return true, err
		}
		// Waiting, not falling back to the RPC: a request's parts must reach the agent
		// in order.
		if err := e.Err(); err != nil {
			return true, fmt.Errorf("doorbell: the session ended: %w", err)
		}
		select {
		case <-ctx.Done():
			return true, ctx.Err()
		case <-time.After(fullNap):
		}
	}
	var one [8]byte
	one[0] = 1
	_, err = b.ring.Write(one[:])
	return true, err
}
