package agent_test

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"

	"github.com/kvhandoff/kvhandoff/test/simengine"
	agentv1 "github.com/kvhandoff/kvhandoff/transferagent/api/v1"
	"github.com/kvhandoff/kvhandoff/transferagent/client"
	"github.com/kvhandoff/kvhandoff/transferagent/doorbell"
)

// bellEngine is an engine rank whose reports and events go through a doorbell.
func bellEngine(t *testing.T, a *agentProc, id string, role agentv1.Role, mode agentv1.Mode, l simengine.Layout) *simengine.Engine {
	t.Helper()
	ctx, cancel := context.WithTimeout(bg, 30*time.Second)
	defer cancel()
	e, err := simengine.Start(ctx, simengine.Config{ID: id, Role: role, Mode: mode, Layout: l, Socket: a.Socket, Doorbell: true})
	if err != nil {
		t.Fatalf("starting engine %s with a doorbell: %v", id, err)
	}
	t.Cleanup(e.Stop)
	return e
}

// Push and pull hand off verified bytes with every report and event on doorbells: a
// push reported in two parts, before and after its registration, and a pull.
func TestHandoffsThroughDoorbellsDeliverVerifiedBytes(t *testing.T) {
	l := testLayout(1, 128)
	for _, mode := range []agentv1.Mode{agentv1.Mode_MODE_PUSH, agentv1.Mode_MODE_PULL} {
		t.Run(mode.String(), func(t *testing.T) {
			a, b := startAgent(t, "prefill-node", t.TempDir()), startAgent(t, "decode-node", t.TempDir())
			pe := bellEngine(t, a, "prefill-0.default", agentv1.Role_ROLE_PREFILL, mode, l)
			de := bellEngine(t, b, "decode-0.default", agentv1.Role_ROLE_DECODE, mode, l)
			for i := range 3 {
				req := fmt.Sprintf("bell-%d", i)
				src, dst := alloc(t, pe, 12), alloc(t, de, 12)
				pe.Cache.Fill(req, src)
				if err := pe.SourceReady(bg, req, 0, src[:5], false); err != nil {
					t.Fatal(err)
				}
				var err error
				if mode == agentv1.Mode_MODE_PUSH {
					err = de.RegisterDestination(bg, req, 1, dst, pe.Self)
				} else {
					err = de.Pull(bg, req, 1, pe.Self, src, dst)
				}
				if err != nil {
					t.Fatal(err)
				}
				if err := pe.SourceReady(bg, req, 5, src[5:], true); err != nil {
					t.Fatal(err)
				}
				expect(t, wait(t, de, req, 1), agentv1.Event_DELIVERED)
				expect(t, wait(t, pe, req, 1), agentv1.Event_SOURCE_DONE)
				if err := de.Cache.Verify(req, dst); err != nil {
					t.Fatal(err)
				}
				pe.Free(src)
				de.Free(dst)
			}
			// Every report, pull and event crossed a doorbell: two reports per request on
			// the prefill node (and in pull a pull on the decode node), and each side's
			// one event.
			pulls := 0.0
			if mode == agentv1.Mode_MODE_PULL {
				pulls = 3
			}
			for _, c := range []struct {
				a    *agentProc
				dir  string
				want float64
			}{{a, "report", 6}, {a, "event", 3}, {b, "event", 3}, {b, "report", pulls}} {
				// The prefill side's last event (its source sent) may cross just after the
				// decode side's delivery, which ends the handoff here: wait for it.
				series := `kvhandoff_agent_doorbell_records_total{direction="` + c.dir + `"}`
				until(t, fmt.Sprintf("%s: %v doorbell records of direction %s", c.a.Name, c.want, c.dir), func() bool { return c.a.Metric(t, series) >= c.want })
				if n := c.a.Metric(t, series); n != c.want {
					t.Errorf("%s: %v doorbell records of direction %s, want %v", c.a.Name, n, c.dir, c.want)
				}
			}
		})
	}
}

// A report the agent refuses comes back as a FAILED event naming the field, as the RPC's
// error would have, and leaves the session working.
func TestARefusedDoorbellReportComesBackAsAFailedEvent(t *testing.T) {
	a := startAgent(t, "prefill-node", t.TempDir())
	pe := bellEngine(t, a, "prefill-0.default", agentv1.Role_ROLE_PREFILL, agentv1.Mode_MODE_PULL, testLayout(1, 64))
	if err := pe.SourceReady(bg, "too-far", 0, []uint32{64}, true); err != nil {
		t.Fatalf("a report through the doorbell returned %v; the agent answers with an event", err)
	}
	ev := wait(t, pe, "too-far", 0)
	expect(t, ev, agentv1.Event_FAILED)
	if !strings.Contains(ev.Reason, "block_ids") {
		t.Errorf("the FAILED event says %q; want it to name block_ids", ev.Reason)
	}
	if n := a.Metric(t, `kvhandoff_agent_refused_total{call="doorbell",code="InvalidArgument"}`); n != 1 {
		t.Errorf("refused doorbell reports: %v, want 1", n)
	}
	if err := pe.SourceReady(bg, "fine", 0, alloc(t, pe, 4), true); err != nil {
		t.Fatal(err)
	}
	select {
	case <-pe.Done():
		t.Fatalf("the session ended after a refused report: %v", pe.Err())
	default:
	}
}

// A pull the agent refuses through the doorbell (its destination blocks past the cache)
// comes back as a FAILED event for its attempt, naming the field.
func TestARefusedDoorbellPullComesBackAsAFailedEvent(t *testing.T) {
	a, b := startAgent(t, "prefill-node", t.TempDir()), startAgent(t, "decode-node", t.TempDir())
	l := testLayout(1, 64)
	pe := bellEngine(t, a, "prefill-0.default", agentv1.Role_ROLE_PREFILL, agentv1.Mode_MODE_PULL, l)
	de := bellEngine(t, b, "decode-0.default", agentv1.Role_ROLE_DECODE, agentv1.Mode_MODE_PULL, l)
	if err := de.Pull(bg, "too-far", 3, pe.Self, []uint32{1}, []uint32{64}); err != nil {
		t.Fatalf("a pull through the doorbell returned %v; the agent answers with an event", err)
	}
	ev := wait(t, de, "too-far", 3)
	expect(t, ev, agentv1.Event_FAILED)
	if !strings.Contains(ev.Reason, "destination_block_ids") {
		t.Errorf("the FAILED event says %q; want it to name destination_block_ids", ev.Reason)
	}
}

// rawBell passes fds as a doorbell for session, as any engine could, and returns the
// agent's answer and the fds it carried (closed when the test ends).
func rawBell(t *testing.T, a *agentProc, session string, fds ...int) (string, []int, error) {
	t.Helper()
	c, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: agentv1.MemorySocket(a.Socket), Net: "unixpacket"})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, _, err := c.WriteMsgUnix([]byte(agentv1.DoorbellPrefix+session), unix.UnixRights(fds...), nil); err != nil {
		t.Fatal(err)
	}
	buf, oob := make([]byte, 512), make([]byte, unix.CmsgSpace(4*4))
	n, oobn, _, _, err := c.ReadMsgUnix(buf, oob)
	if err != nil {
		t.Fatal(err)
	}
	var got []int
	msgs, err := unix.ParseSocketControlMessage(oob[:oobn])
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range msgs {
		fds, err := unix.ParseUnixRights(&m)
		if err != nil {
			t.Fatal(err)
		}
		got = append(got, fds...)
	}
	t.Cleanup(func() { closeFDs(got) })
	_, err = agentv1.ParseMemoryAnswer(buf[:n])
	return string(buf[:n]), got, err
}

func closeFDs(fds []int) {
	for _, fd := range fds {
		unix.Close(fd)
	}
}

// openBell passes a well-formed doorbell of capacity for e's session and returns its
// mapping and the eventfds the agent answered with: the one to ring, the one it rings.
func openBell(t *testing.T, a *agentProc, e *simengine.Engine, capacity uint64) (mem []byte, ring, wake int) {
	t.Helper()
	fd, mem := bellMemory(t, capacity)
	answer, efds, err := rawBell(t, a, e.Session, fd)
	if err != nil || len(efds) != 2 {
		t.Fatalf("a well-formed doorbell: answer %q with %d fds; want ok with 2 eventfds", answer, len(efds))
	}
	return mem, efds[0], efds[1]
}

// report writes n SourceReady reports of a block past the layout (each refused with a
// FAILED event) into the submit ring, ringing after each batch that fits.
func report(t *testing.T, mem []byte, capacity uint64, ring int, n int) {
	t.Helper()
	submit := doorbell.Submit(mem, capacity).AsProducer() // after what earlier calls wrote
	for i := 0; i < n; {
		msg, _ := proto.Marshal(&agentv1.SourceReadyRequest{RequestId: fmt.Sprintf("r-%d", i), BlockIds: []uint32{1 << 20}, Final: true})
		switch err := submit.Put(doorbell.KindSourceReady, msg); {
		case err == nil:
			i++
			continue
		case !errors.Is(err, doorbell.ErrFull):
			t.Fatal(err)
		}
		ringBell(t, ring, 1)
		until(t, "the agent drains the submit ring", func() bool { return word(mem, 64) == word(mem, 128) })
	}
	ringBell(t, ring, 1)
}

// word reads a doorbell header's index at off (package doorbell's layout): submit head
// 64, submit tail 128, events tail 256.
func word(mem []byte, off int) uint64 {
	return atomic.LoadUint64((*uint64)(unsafe.Pointer(&mem[off])))
}

// ringBell rings a bell with v. EAGAIN means the bell is full: it is already rung, which
// is all a ring says.
func ringBell(t *testing.T, fd int, v uint64) {
	t.Helper()
	if _, err := unix.Write(fd, binary.NativeEndian.AppendUint64(nil, v)); err != nil && err != unix.EAGAIN {
		t.Fatal(err)
	}
}

func bellMemory(t *testing.T, capacity uint64) (int, []byte) {
	t.Helper()
	fd, mem, err := client.NewMemory("bell", int(doorbell.Size(capacity)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Close(fd); unix.Munmap(mem) })
	if err := doorbell.Init(mem, capacity); err != nil {
		t.Fatal(err)
	}
	return fd, mem
}

// The attack: an engine leaves its doorbell unable to take events — its wake bell
// blocking and never read, or its events ring full and never read — and exits. Its session
// ends with its event stream, as any engine's does (before, the agent blocked writing to
// the eventfd, or waited for room forever, and the rank stayed taken until a restart).
func TestADoorbellThatTakesNoEventsEndsWithItsEngine(t *testing.T) {
	const capacity = doorbell.MinCapacity
	for _, tc := range []struct {
		name    string
		reports int
		jam     func(t *testing.T, wake int)
	}{
		{"wake bell blocking and never read", 1, func(t *testing.T, wake int) {
			if err := unix.SetNonblock(wake, false); err != nil {
				t.Fatal(err)
			}
		}},
		// 64 KiB of events ring holds some hundreds of FAILED events.
		{"events ring never read", 3000, func(*testing.T, int) {}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a := startAgent(t, "prefill-node", t.TempDir())
			l := testLayout(1, 64)
			e := engine(t, a, "prefill-0.default", agentv1.Role_ROLE_PREFILL, agentv1.Mode_MODE_PULL, 0, l)
			mem, ring, wake := openBell(t, a, e, capacity)
			tc.jam(t, wake)
			report(t, mem, capacity, ring, tc.reports)
			until(t, "the agent writes events into the ring", func() bool { return word(mem, 256) > 0 })
			e.Stop() // the engine exits
			until(t, "the session ends", func() bool {
				return a.Metric(t, "kvhandoff_agent_engine_sessions") == 0
			})
			engine(t, a, "prefill-0.default", agentv1.Role_ROLE_PREFILL, agentv1.Mode_MODE_PULL, 0, l) // the rank is free
		})
	}
}

// The agent makes the doorbell's bells: an eventfd an engine passes is refused, so no
// engine can hand it an EFD_SEMAPHORE eventfd, which answers each read with 1 (one write
// of 2^64-2 then kept an agent core busy for as long as the session lived). A ring of
// that value on the agent's bell is one ring, and the session goes on.
func TestADoorbellsBellsAreTheAgents(t *testing.T) {
	a := startAgent(t, "prefill-node", t.TempDir())
	e := engine(t, a, "prefill-0.default", agentv1.Role_ROLE_PREFILL, agentv1.Mode_MODE_PULL, 0, testLayout(1, 64))
	fd, _ := bellMemory(t, doorbell.MinCapacity)
	sem, err := unix.Eventfd(0, unix.EFD_CLOEXEC|unix.EFD_SEMAPHORE)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(sem)
	if answer, _, err := rawBell(t, a, e.Session, fd, sem); err == nil || !strings.Contains(answer, "memfd alone") {
		t.Fatalf("a doorbell with the engine's semaphore eventfd: %q; want a refusal", answer)
	}
	mem, ring, _ := openBell(t, a, e, doorbell.MinCapacity)
	ringBell(t, ring, 1<<64-2)
	report(t, mem, doorbell.MinCapacity, ring, 1)
	until(t, "the agent answers the report after the large ring", func() bool { return word(mem, 256) > 0 })
	if got := a.Metric(t, "kvhandoff_agent_engine_sessions"); got != 1 {
		t.Fatalf("%v sessions after ringing 2^64-2; want the engine's 1", got)
	}
}

// The attack: an engine writes garbage into its doorbell's ring (here a tail far past
// the capacity) and rings. The agent ends that engine's session, saying why, and keeps
// serving another engine's.
func TestACorruptDoorbellEndsOnlyItsOwnSession(t *testing.T) {
	a := startAgent(t, "prefill-node", t.TempDir())
	l := testLayout(1, 64)
	hostile := engine(t, a, "prefill-0.default", agentv1.Role_ROLE_PREFILL, agentv1.Mode_MODE_PULL, 0, l)
	other := bellEngine(t, a, "prefill-1.default", agentv1.Role_ROLE_PREFILL, agentv1.Mode_MODE_PULL, l)
	mem, ring, _ := openBell(t, a, hostile, doorbell.MinCapacity)
	binary.LittleEndian.PutUint64(mem[128:], 1<<40) // the submit ring's tail
	if _, err := unix.Write(ring, binary.LittleEndian.AppendUint64(nil, 1)); err != nil {
		t.Fatal(err)
	}
	select {
	case <-hostile.Done():
	case <-time.After(30 * time.Second):
		t.Fatal("the session of a corrupt doorbell lives on")
	}
	if err := hostile.Err(); err == nil || !strings.Contains(err.Error(), "corrupt ring") {
		t.Errorf("the session ended with %v; want it to say the ring was corrupt", err)
	}
	if n := a.Metric(t, `kvhandoff_agent_refused_total{call="doorbell",code="InvalidArgument"}`); n != 1 {
		t.Errorf("refused doorbells: %v, want 1", n)
	}
	// The other engine's doorbell is still drained: its refused report is answered.
	if err := other.SourceReady(bg, "still-served", 0, []uint32{64}, true); err != nil {
		t.Fatal(err)
	}
	expect(t, wait(t, other, "still-served", 0), agentv1.Event_FAILED)
}

// What a doorbell packet must hold: one sealed memfd of the layout's size with a valid
// header, for a session of the caller's; one doorbell per session. Each refusal says why
// and passes no fds back.
func TestADoorbellThatBreaksTheRulesIsRefused(t *testing.T) {
	a := startAgent(t, "prefill-node", t.TempDir())
	e := engine(t, a, "prefill-0.default", agentv1.Role_ROLE_PREFILL, agentv1.Mode_MODE_PULL, 0, testLayout(1, 64))
	fd, mem := bellMemory(t, doorbell.MinCapacity)
	var pipe [2]int
	if err := unix.Pipe2(pipe[:], unix.O_CLOEXEC); err != nil {
		t.Fatal(err)
	}
	defer unix.Close(pipe[0])
	defer unix.Close(pipe[1])
	unsealed, err := unix.MemfdCreate("unsealed", unix.MFD_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(unsealed)
	if err := unix.Ftruncate(unsealed, int64(doorbell.Size(doorbell.MinCapacity))); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name, want string
		fds        func() []int
		session    string
	}{
		{"an eventfd of the engine's", "memfd alone", func() []int { return []int{fd, eventfd(t)} }, e.Session},
		{"no fd", "memfd alone", func() []int { return nil }, e.Session},
		{"a pipe for the memfd", "not a regular file", func() []int { return []int{pipe[1]} }, e.Session},
		{"an unsealed memfd", "not sealed", func() []int { return []int{unsealed} }, e.Session},
		{"another owner's or no session", "session", func() []int { return []int{fd} }, "no-such-session"},
		{"a wrong magic", "magic", func() []int {
			binary.LittleEndian.PutUint64(mem[0:], 7)
			return []int{fd}
		}, e.Session},
	} {
		t.Run(tc.name, func(t *testing.T) {
			answer, fds, err := rawBell(t, a, tc.session, tc.fds()...)
			if err == nil || !strings.Contains(answer, tc.want) || len(fds) != 0 {
				t.Fatalf("answer %q with %d fds; want a refusal saying %q, with none", answer, len(fds), tc.want)
			}
		})
	}
	if err := doorbell.Init(mem, doorbell.MinCapacity); err != nil {
		t.Fatal(err)
	}
	openBell(t, a, e, doorbell.MinCapacity)
	if answer, _, err := rawBell(t, a, e.Session, fd); err == nil || !strings.Contains(answer, "has one already") {
		t.Fatalf("a second doorbell: %q; want a refusal", answer)
	}
	select {
	case <-e.Done():
		t.Fatalf("refused doorbells ended the session: %v", e.Err())
	default:
	}
}

func eventfd(t *testing.T) int {
	t.Helper()
	fd, err := unix.Eventfd(0, unix.EFD_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Close(fd) })
	return fd
}

// The attack: an engine makes its ends of the bells blocking (with eventfds, whose flags
// every holder shares, that made the agent's copy blocking too). (a) It never reads its
// wake bell while the agent rings it thousands of times: the agent keeps answering its
// reports, and when the engine exits its session ends and the rank is free (before, the
// agent blocked writing under the bell's lock, the session lived on and the rank was
// taken). (b) It opens and closes sessions with doorbells, over and over: the agent's
// threads and fds come back to where they were (before, each closed session left a thread
// blocked in read, two fds and two goroutines behind). The engine cannot write into the
// agent's wake end either.
func TestAnEngineCannotMakeTheAgentsBellsBlock(t *testing.T) {
	const capacity = doorbell.MinCapacity
	a := startAgent(t, "prefill-node", t.TempDir())
	l := testLayout(1, 64)
	blocking := func(t *testing.T, fds ...int) {
		for _, fd := range fds {
			if err := unix.SetNonblock(fd, false); err != nil {
				t.Fatal(err)
			}
		}
	}

	t.Run("wake bell never read", func(t *testing.T) {
		e := engine(t, a, "prefill-0.default", agentv1.Role_ROLE_PREFILL, agentv1.Mode_MODE_PULL, 0, l)
		mem, ring, wake := openBell(t, a, e, capacity)
		blocking(t, ring, wake)
		// Fill it, as an eventfd's counter could be filled: the agent's end takes nothing.
		_, fill := unix.Write(wake, binary.NativeEndian.AppendUint64(nil, 1<<64-2))
		// Each refused report is an event and a ring: read the events (so the ring never
		// fills) and never the bell, 4,000 times, far past what a socket buffer holds.
		events := doorbell.Events(mem, capacity)
		read := 0
		for sent := 0; sent < 4000; {
			n := min(100, 4000-sent)
			report(t, mem, capacity, ring, n)
			sent += n
			until(t, "the agent answers every report", func() bool {
				got, err := events.Drain(func(doorbell.Kind, []byte) error { return nil })
				if err != nil {
					t.Fatal(err)
				}
				read += got
				return read == sent
			})
		}
		e.Stop()
		until(t, "the session ends", func() bool { return a.Metric(t, "kvhandoff_agent_engine_sessions") == 0 })
		engine(t, a, "prefill-0.default", agentv1.Role_ROLE_PREFILL, agentv1.Mode_MODE_PULL, 0, l).Stop() // the rank is free
		until(t, "the session ends", func() bool { return a.Metric(t, "kvhandoff_agent_engine_sessions") == 0 })
		if !errors.Is(fill, unix.EPIPE) {
			t.Errorf("filling the agent's wake end: %v, want EPIPE", fill)
		}
	})

	t.Run("sessions opened and closed", func(t *testing.T) {
		threads, fds := procCounts(t, a.Pid())
		for i := range 200 {
			e := engine(t, a, fmt.Sprintf("churn-%d.default", i%4), agentv1.Role_ROLE_PREFILL, agentv1.Mode_MODE_PULL, 0, l)
			mem, ring, wake := openBell(t, a, e, capacity)
			blocking(t, ring, wake)
			report(t, mem, capacity, ring, 1)
			e.Stop()
			unix.Close(ring)
			unix.Close(wake)
			until(t, "the session ends", func() bool { return a.Metric(t, "kvhandoff_agent_engine_sessions") == 0 })
		}
		var nt, nf int
		until(t, "the agent's threads and fds back where they were", func() bool {
			nt, nf = procCounts(t, a.Pid())
			return nt <= threads+8 && nf <= fds+8
		})
		t.Logf("after 200 sessions with blocking bells: %d threads (%d before), %d fds (%d before)", nt, threads, nf, fds)
	})
}

// procCounts is a process's threads and open fds.
func procCounts(t *testing.T, pid int) (threads, fds int) {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		if f := strings.Fields(l); len(f) == 2 && f[0] == "Threads:" {
			threads, _ = strconv.Atoi(f[1])
		}
	}
	ents, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
	if err != nil {
		t.Fatal(err)
	}
	return threads, len(ents)
}
