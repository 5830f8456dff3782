package agent_test

import (
	"bufio"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	agentv1 "github.com/kvhandoff/kvhandoff/transferagent/api/v1"
	"github.com/kvhandoff/kvhandoff/transferagent/client"
	"github.com/kvhandoff/kvhandoff/transferagent/wire"
)

// refused asserts a call failed with code and a message naming what was wrong.
func refused(t *testing.T, what string, err error, code codes.Code, mentions string) {
	t.Helper()
	if err == nil {
		t.Errorf("%s: accepted", what)
		return
	}
	if st := status.Convert(err); st.Code() != code || !strings.Contains(st.Message(), mentions) {
		t.Errorf("%s: %s %q, want %s mentioning %q", what, st.Code(), st.Message(), code, mentions)
	}
}

func TestBadEngineInputIsRefusedAndTheAgentKeepsServing(t *testing.T) {
	p := newPair(t, agentv1.Mode_MODE_PUSH, 1, 64)
	cl, err := client.Dial(p.B.Socket)
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	api := cl.API
	layout := &agentv1.KVLayout{Layers: 1, BlockSize: 16, KvHeads: 8, HeadDim: 16, DtypeBytes: 2}
	reg := func(r *agentv1.RegisterEngineRequest) error { _, err := api.RegisterEngine(bg, r); return err }
	refused(t, "empty engine id", reg(&agentv1.RegisterEngineRequest{Role: agentv1.Role_ROLE_DECODE, Mode: agentv1.Mode_MODE_PUSH, TpSize: 1, Layout: layout}), codes.InvalidArgument, "engine_id")
	refused(t, "rank past size", reg(&agentv1.RegisterEngineRequest{EngineId: "e", Role: agentv1.Role_ROLE_DECODE, Mode: agentv1.Mode_MODE_PUSH, TpRank: 2, TpSize: 2, Layout: layout}), codes.InvalidArgument, "tp_rank")
	refused(t, "heads that do not split", reg(&agentv1.RegisterEngineRequest{EngineId: "e", Role: agentv1.Role_ROLE_DECODE, Mode: agentv1.Mode_MODE_PUSH, TpSize: 3, Layout: layout}), codes.InvalidArgument, "layout.kv_heads")

	e, err := cl.RegisterEngine(bg, &agentv1.RegisterEngineRequest{EngineId: "bad-input", Role: agentv1.Role_ROLE_DECODE, Mode: agentv1.Mode_MODE_PUSH, TpSize: 1, Layout: layout})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	file := filepath.Join(p.B.MemoryDir, "bad-input.kv")
	if err := os.WriteFile(file, make([]byte, 1<<16), 0o600); err != nil {
		t.Fatal(err)
	}
	region := func(id uint32, path string, off, size uint64, kind agentv1.MemoryKind) error {
		_, err := api.RegisterRegion(bg, &agentv1.RegisterRegionRequest{Session: e.Session, RegionId: id, Kind: kind, Path: path, Offset: off, Size: size, BlockLen: 1024, BlockCount: 16})
		return err
	}
	host := agentv1.MemoryKind_MEMORY_KIND_HOST
	refused(t, "a file outside the memory directory", region(0, "/etc/hostname", 0, 16<<10, host), codes.InvalidArgument, "outside the memory directory")
	refused(t, "a symlink out of the memory directory", func() error {
		link := filepath.Join(p.B.MemoryDir, "escape")
		if err := os.Symlink("/etc/hostname", link); err != nil {
			t.Fatal(err)
		}
		return region(0, link, 0, 16<<10, host)
	}(), codes.InvalidArgument, "outside the memory directory")
	refused(t, "a region past the file's end", region(0, file, 60<<10, 16<<10, host), codes.InvalidArgument, "size")
	refused(t, "blocks that do not fit the size", region(0, file, 0, 8<<10, host), codes.InvalidArgument, "size")
	refused(t, "device memory without FI_MR_DMABUF", region(0, file, 0, 16<<10, agentv1.MemoryKind_MEMORY_KIND_CUDA), codes.FailedPrecondition, "FI_MR_DMABUF")
	if err := region(0, file, 0, 16<<10, host); err != nil {
		t.Fatal(err)
	}
	refused(t, "a duplicate region id", region(0, file, 32<<10, 16<<10, host), codes.AlreadyExists, "region_id")
	refused(t, "an overlapping region", region(1, file, 8<<10, 16<<10, host), codes.AlreadyExists, "overlap")
	// Another engine naming the same memory is refused too.
	refused(t, "another engine's memory", func() error {
		other, err := cl.RegisterEngine(bg, &agentv1.RegisterEngineRequest{EngineId: "thief", Role: agentv1.Role_ROLE_DECODE, Mode: agentv1.Mode_MODE_PUSH, TpSize: 1, Layout: layout})
		if err != nil {
			t.Fatal(err)
		}
		defer other.Close()
		_, err = api.RegisterRegion(bg, &agentv1.RegisterRegionRequest{Session: other.Session, RegionId: 0, Kind: host, Path: file, Offset: 0, Size: 16 << 10, BlockLen: 1024, BlockCount: 16})
		return err
	}(), codes.AlreadyExists, "overlap")

	src := p.P[0].Self
	dest := func(req string, blocks []uint32, source *agentv1.EngineRef) error {
		_, err := api.RegisterDestination(bg, &agentv1.RegisterDestinationRequest{Session: e.Session, RequestId: req, Attempt: 1, BlockIds: blocks, Source: source})
		return err
	}
	refused(t, "a block outside the region", dest("r", []uint32{3, 16}, src), codes.InvalidArgument, "block_ids[1]")
	refused(t, "no blocks", dest("r", nil, src), codes.InvalidArgument, "block_ids")
	refused(t, "no request id", dest("", []uint32{1}, src), codes.InvalidArgument, "request_id")
	refused(t, "a source of another rank", dest("r", []uint32{1}, &agentv1.EngineRef{Agent: src.Agent, EngineId: src.EngineId, TpRank: 1}), codes.InvalidArgument, "source.tp_rank")
	refused(t, "an unknown session", func() error {
		_, err := api.Heartbeat(bg, &agentv1.HeartbeatRequest{Session: "nope"})
		return err
	}(), codes.NotFound, "session")
	refused(t, "a call the role does not allow", func() error {
		_, err := api.SourceReady(bg, &agentv1.SourceReadyRequest{Session: e.Session, RequestId: "r", BlockIds: []uint32{1}, Final: true})
		return err
	}(), codes.FailedPrecondition, "SourceReady")
	huge := make([]uint32, 2<<20) // 10 MiB encoded, over the 8 MiB limit
	for i := range huge {
		huge[i] = 1 << 30
	}
	refused(t, "an oversized message", dest("r", huge, src), codes.ResourceExhausted, "larger than max")
	// A valid registration stays outstanding (no source yet): a second one is a duplicate.
	if err := p.D[0].RegisterDestination(bg, "dup", 1, []uint32{1, 2}, src); err != nil {
		t.Fatal(err)
	}
	refused(t, "a duplicate registration", p.D[0].RegisterDestination(bg, "dup", 1, []uint32{1, 2}, src), codes.AlreadyExists, "already registered")
	refused(t, "regions added after the first transfer", region(2, file, 32<<10, 16<<10, host), codes.FailedPrecondition, "fixed")

	// Prefill side: a position reported twice, a block outside the regions.
	ready := func(off uint32, blocks []uint32) error { return p.P[0].SourceReady(bg, "twice", off, blocks, false) }
	if err := ready(0, []uint32{1, 2}); err != nil {
		t.Fatal(err)
	}
	refused(t, "a position reported twice", ready(1, []uint32{3}), codes.InvalidArgument, "twice")
	refused(t, "a source block outside the regions", ready(2, []uint32{64}), codes.InvalidArgument, "block_ids[0]")

	if got := p.B.Metric(t, `kvhandoff_agent_refused_total{call="RegisterRegion",code="AlreadyExists"}`); got != 3 {
		t.Errorf("refused RegisterRegion/AlreadyExists counted %v, want 3", got)
	}
	if got := p.B.Metric(t, `kvhandoff_agent_refused_total{call="RegisterDestination",code="ResourceExhausted"}`); got != 1 {
		t.Errorf("refused oversized messages counted %v, want 1", got)
	}
	// After all of that, both agents still serve.
	transfer(t, p.P[0], p.D[0], "after-bad-input")
}

func TestPeersMustAuthenticateAndMalformedFramesAreRefused(t *testing.T) {
	p := newPair(t, agentv1.Mode_MODE_PUSH, 1, 64)
	send := func(frames ...[]byte) {
		c, err := net.Dial("tcp", p.A.Peer)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		for _, f := range frames {
			c.Write(f)
		}
		c.(*net.TCPConn).CloseWrite() // a truncated frame then ends at EOF, not at the handshake timeout
		// The agent answers with its Hello, then closes the connection on us.
		c.SetReadDeadline(time.Now().Add(10 * time.Second))
		buf := make([]byte, 4096)
		for {
			if _, err := c.Read(buf); err != nil {
				break
			}
		}
	}
	hello, _ := wire.Encode(nil, &wire.Hello{Agent: "intruder", Epoch: 1, Nonce: "0123456789abcdef0123"})
	badAuth, _ := wire.Encode(nil, &wire.Auth{MAC: "not the token's mac"})
	send(hello, badAuth)
	send([]byte{0, 0, 0, 3, 9, 9, 9})    // not a frame of this protocol
	send([]byte{0xff, 0xff, 0xff, 0xff}) // a length over the limit
	send(hello[:len(hello)-3])           // truncated
	reg, _ := wire.Encode(nil, &wire.Register{Request: "r", Source: p.P[0].Self.EngineId + "/0", Blocks: []uint32{1}})
	send(reg) // a registration before any handshake
	if got := p.A.Metric(t, `kvhandoff_agent_refused_total{call="peer",code="Unauthenticated"}`); got != 5 {
		t.Errorf("refused peer handshakes: %v, want 5", got)
	}
	transfer(t, p.P[0], p.D[0], "after-intruders")
}

func TestSIGTERMDrainsAndExitsCleanly(t *testing.T) {
	p := newPair(t, agentv1.Mode_MODE_PUSH, 1, 64)
	transfer(t, p.P[0], p.D[0], "before-shutdown")
	if err := p.A.Stop(); err != nil {
		t.Fatalf("SIGTERM: %v (libfabric's providers must not take over the signal)\n%s", err, p.A.Log())
	}
	if _, err := os.Stat(p.A.Socket); !os.IsNotExist(err) {
		t.Errorf("the socket is still there after shutdown: %v", err)
	}
	if !strings.Contains(p.A.Log(), `"msg":"stopped"`) {
		t.Error("the agent did not log its orderly stop")
	}
}

func TestAnUnavailableProviderFailsReadinessWithoutFallingBack(t *testing.T) {
	a := startAgent(t, "no-efa", t.TempDir(), "--provider", "efa")
	code, body, err := a.Get("/readyz")
	if err != nil {
		t.Fatal(err)
	}
	if code != 503 || !strings.Contains(body, `provider "efa" unavailable`) {
		t.Fatalf("readyz: %d %q", code, body)
	}
	cl, err := client.Dial(a.Socket)
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	_, err = cl.API.RegisterEngine(bg, &agentv1.RegisterEngineRequest{EngineId: "e", Role: agentv1.Role_ROLE_DECODE, Mode: agentv1.Mode_MODE_PUSH, TpSize: 1,
		Layout: &agentv1.KVLayout{Layers: 1, BlockSize: 16, KvHeads: 8, HeadDim: 16, DtypeBytes: 2}})
	refused(t, "an engine on an agent without its provider", err, codes.Unavailable, "efa")
}

// A client without the token tries to make the agent sign its own challenge: on a second
// connection it hands the agent the first connection's nonce as its own, hoping for an
// Auth it can replay on the first. The agent must sign nothing for a party that has not
// proved itself, and accept neither connection.
func TestAHandshakeCannotBeReflected(t *testing.T) {
	p := newPair(t, agentv1.Mode_MODE_PUSH, 1, 64)
	dial := func() (net.Conn, *bufio.Reader, *wire.Hello) {
		c, err := net.Dial("tcp", p.A.Peer)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		c.SetDeadline(time.Now().Add(10 * time.Second))
		r := bufio.NewReader(c)
		m, err := wire.Read(r)
		if err != nil {
			t.Fatal(err)
		}
		return c, r, m.(*wire.Hello)
	}
	write := func(c net.Conn, m wire.Message) {
		b, _ := wire.Encode(nil, m)
		c.Write(b)
	}
	peersBefore := p.A.Metric(t, "kvhandoff_agent_peer_connections")
	c1, r1, h1 := dial()
	c2, r2, _ := dial()
	// On the second connection: the first connection's challenge as ours, then an Auth we
	// cannot make. The old handshake answered the Hello with the agent's MAC of that nonce
	// at once, before checking anything.
	write(c2, &wire.Hello{Agent: "intruder", Epoch: 1, Nonce: h1.Nonce})
	write(c2, &wire.Auth{MAC: "cannot make this"})
	var stolen string
	if m, err := wire.Read(r2); err == nil {
		if a, ok := m.(*wire.Auth); ok {
			stolen = a.MAC
			t.Errorf("the agent signed a challenge for a party that had not proved itself")
		}
	}
	// Replay whatever came back on the first connection.
	write(c1, &wire.Hello{Agent: "intruder", Epoch: 1, Nonce: "fedcba9876543210fedcba9876543210"})
	write(c1, &wire.Auth{MAC: stolen})
	if m, err := wire.Read(r1); err == nil {
		t.Errorf("the agent answered the replayed proof with %T: the reflection got through", m)
	}
	if got := p.A.Metric(t, `kvhandoff_agent_refused_total{call="peer",code="Unauthenticated"}`); got != 2 {
		t.Errorf("refused handshakes: %v, want 2", got)
	}
	if got := p.A.Metric(t, "kvhandoff_agent_peer_connections"); got > peersBefore {
		t.Errorf("peer connections went from %v to %v", peersBefore, got)
	}
	transfer(t, p.P[0], p.D[0], "after-reflection")
}

// Before a peer has proved itself the agent spends little on it: handshake frames are
// small, and connections mid-handshake are capped.
func TestUnauthenticatedPeersCannotExhaustTheAgent(t *testing.T) {
	p := newPair(t, agentv1.Mode_MODE_PUSH, 1, 64)
	// A frame announced at 1 MiB before authentication is refused on its length alone:
	// the agent closes the connection without waiting for (or allocating) the body.
	c, err := net.Dial("tcp", p.A.Peer)
	if err != nil {
		t.Fatal(err)
	}
	c.Write(binary.BigEndian.AppendUint32(nil, 1<<20))
	c.SetReadDeadline(time.Now().Add(5 * time.Second)) // well inside the 10 s handshake timeout
	r := bufio.NewReader(c)
	if _, err := wire.Read(r); err != nil { // the agent's own Hello
		t.Fatal(err)
	}
	if _, err := wire.Read(r); !errors.Is(err, io.EOF) {
		t.Errorf("after a 1 MiB frame header the agent did not close the connection at once (%v): it waits to read the body", err)
	}
	c.Close()

	// Connections that never finish a handshake: beyond the cap they are closed at once.
	const flood = 100
	var conns []net.Conn
	for range flood {
		c, err := net.Dial("tcp", p.A.Peer)
		if err != nil {
			t.Fatal(err)
		}
		conns = append(conns, c)
	}
	until(t, "the connections past the cap are refused", func() bool {
		return p.A.Metric(t, `kvhandoff_agent_refused_total{call="peer",code="ResourceExhausted"}`) == flood-64
	})
	for _, c := range conns {
		c.Close()
	}
	transfer(t, p.P[0], p.D[0], "after-the-flood")
}

// A socket user may not take over another engine's rank by registering its id, and a
// session that never opens its event stream does not hold the agent's resources forever.
func TestSessionsCannotBeEvictedOrLeftDangling(t *testing.T) {
	p := newPair(t, agentv1.Mode_MODE_PUSH, 1, 64, "--events-deadline", "500ms")
	cl, err := client.Dial(p.A.Socket)
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	layout := &agentv1.KVLayout{Layers: 2, BlockSize: 16, KvHeads: 8, HeadDim: 16, DtypeBytes: 2}
	sessions := func() float64 { return p.A.Metric(t, "kvhandoff_agent_engine_sessions") }
	live := sessions()

	// The prefill engine's rank is live: registering its id again is refused, and it serves on.
	victim := &agentv1.RegisterEngineRequest{EngineId: p.P[0].Self.EngineId, Role: agentv1.Role_ROLE_PREFILL, Mode: agentv1.Mode_MODE_PUSH, TpSize: 1, Layout: layout}
	_, err = cl.API.RegisterEngine(bg, victim)
	refused(t, "registering a live engine's id", err, codes.AlreadyExists, "live session")
	transfer(t, p.P[0], p.D[0], "after-the-eviction-attempt")

	// A registration that never opens its event stream is closed after the deadline.
	if _, err := cl.API.RegisterEngine(bg, &agentv1.RegisterEngineRequest{EngineId: "never-listens", Role: agentv1.Role_ROLE_DECODE, Mode: agentv1.Mode_MODE_PUSH, TpSize: 1, Layout: layout}); err != nil {
		t.Fatal(err)
	}
	if got := sessions(); got != live+1 {
		t.Fatalf("sessions: %v, want %v", got, live+1)
	}
	until(t, "the session without an event stream is closed", func() bool { return sessions() == live })

	// The live incarnation itself may hand its rank over, naming its session.
	victim.ReplacesSession = p.P[0].Session
	resp, err := cl.API.RegisterEngine(bg, victim)
	if err != nil {
		t.Fatalf("the live incarnation replacing itself: %v", err)
	}
	if resp.Epoch <= p.P[0].Epoch {
		t.Errorf("the replacement's epoch %d is not above the replaced one's %d", resp.Epoch, p.P[0].Epoch)
	}
}

// With --socket-gid, engines of that group (not root) can use the socket and create their
// KV files in the memory folder, which keeps new files in the group.
func TestTheSocketGroupReachesTheSocketAndTheMemoryFolder(t *testing.T) {
	a := startAgent(t, "grouped", t.TempDir(), "--socket-gid", "7470")
	for path, want := range map[string]os.FileMode{a.Socket: 0o660, a.MemoryDir: 0o770 | os.ModeSetgid} {
		st, err := os.Stat(path)
		if err != nil {
			t.Fatal(err)
		}
		if gid := st.Sys().(*syscall.Stat_t).Gid; gid != 7470 {
			t.Errorf("%s belongs to group %d, want 7470", path, gid)
		}
		if mode := st.Mode() & (os.ModePerm | os.ModeSetgid); mode != want {
			t.Errorf("%s has mode %v, want %v", path, mode, want)
		}
	}
}

// Engines can write the memory folder's parent (/var/run/kvhandoff): one that swaps the
// folder for a symlink to elsewhere must not make the privileged agent map files there.
func TestSwappingTheMemoryFolderForASymlinkGainsNothing(t *testing.T) {
	a := startAgent(t, "swapped", t.TempDir())
	cl, err := client.Dial(a.Socket)
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	e, err := cl.RegisterEngine(bg, &agentv1.RegisterEngineRequest{EngineId: "swapper", Role: agentv1.Role_ROLE_DECODE, Mode: agentv1.Mode_MODE_PUSH, TpSize: 1,
		Layout: &agentv1.KVLayout{Layers: 1, BlockSize: 16, KvHeads: 8, HeadDim: 16, DtypeBytes: 2}})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	// Elsewhere: a file the engine has no business handing to the agent.
	elsewhere := t.TempDir()
	secret := filepath.Join(elsewhere, "secret")
	if err := os.WriteFile(secret, make([]byte, 1<<16), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(a.MemoryDir, a.MemoryDir+".old"); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(elsewhere, a.MemoryDir); err != nil {
		t.Fatal(err)
	}
	_, err = cl.API.RegisterRegion(bg, &agentv1.RegisterRegionRequest{Session: e.Session, RegionId: 0, Kind: agentv1.MemoryKind_MEMORY_KIND_HOST,
		Path: filepath.Join(a.MemoryDir, "secret"), Size: 16 << 10, BlockLen: 1024, BlockCount: 16})
	refused(t, "a file reached through a swapped memory folder", err, codes.InvalidArgument, "path")
}
