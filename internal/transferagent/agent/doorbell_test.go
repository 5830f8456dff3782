package agent_test

import (
	"context"
	"encoding/binary"
	"fmt"
	"net"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

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
				if n := c.a.Metric(t, `kvhandoff_agent_doorbell_records_total{direction="`+c.dir+`"}`); n != c.want {
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
// agent's answer.
func rawBell(t *testing.T, a *agentProc, session string, fds ...int) (string, error) {
	t.Helper()
	c, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: agentv1.MemorySocket(a.Socket), Net: "unixpacket"})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, _, err := c.WriteMsgUnix([]byte(agentv1.DoorbellPrefix+session), unix.UnixRights(fds...), nil); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 512)
	n, err := c.Read(buf)
	if err != nil {
		t.Fatal(err)
	}
	_, err = agentv1.ParseMemoryAnswer(buf[:n])
	return string(buf[:n]), err
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

func eventfd(t *testing.T) int {
	t.Helper()
	fd, err := unix.Eventfd(0, unix.EFD_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Close(fd) })
	return fd
}

// The attack: an engine writes garbage into its doorbell's ring (here a tail far past
// the capacity) and rings. The agent ends that engine's session, saying why, and keeps
// serving another engine's.
func TestACorruptDoorbellEndsOnlyItsOwnSession(t *testing.T) {
	a := startAgent(t, "prefill-node", t.TempDir())
	l := testLayout(1, 64)
	hostile := engine(t, a, "prefill-0.default", agentv1.Role_ROLE_PREFILL, agentv1.Mode_MODE_PULL, 0, l)
	other := bellEngine(t, a, "prefill-1.default", agentv1.Role_ROLE_PREFILL, agentv1.Mode_MODE_PULL, l)
	fd, mem := bellMemory(t, doorbell.MinCapacity)
	ring := eventfd(t)
	if answer, err := rawBell(t, a, hostile.Session, fd, ring); err != nil {
		t.Fatalf("a well-formed doorbell was refused: %s", answer)
	}
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

// What a doorbell packet must hold: a sealed memfd of the layout's size with a valid
// header, and eventfds; one doorbell per session. Each refusal says why.
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
		{"a pipe for the eventfd", "not an eventfd", func() []int { return []int{fd, pipe[1]} }, e.Session},
		{"an unsealed memfd", "not sealed", func() []int { return []int{unsealed, eventfd(t)} }, e.Session},
		{"no eventfd", "one or two eventfds", func() []int { return []int{fd} }, e.Session},
		{"another owner's or no session", "session", func() []int { return []int{fd, eventfd(t)} }, "no-such-session"},
		{"a wrong magic", "magic", func() []int {
			binary.LittleEndian.PutUint64(mem[0:], 7)
			return []int{fd, eventfd(t)}
		}, e.Session},
	} {
		t.Run(tc.name, func(t *testing.T) {
			answer, err := rawBell(t, a, tc.session, tc.fds()...)
			if err == nil || !strings.Contains(answer, tc.want) {
				t.Fatalf("answer %q; want a refusal saying %q", answer, tc.want)
			}
		})
	}
	if err := doorbell.Init(mem, doorbell.MinCapacity); err != nil {
		t.Fatal(err)
	}
	if answer, err := rawBell(t, a, e.Session, fd, eventfd(t)); err != nil {
		t.Fatalf("a well-formed doorbell was refused: %s", answer)
	}
	if answer, err := rawBell(t, a, e.Session, fd, eventfd(t)); err == nil || !strings.Contains(answer, "has one already") {
		t.Fatalf("a second doorbell: %q; want a refusal", answer)
	}
	select {
	case <-e.Done():
		t.Fatalf("refused doorbells ended the session: %v", e.Err())
	default:
	}
}
