package agent_test

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kvhandoff/kvhandoff/internal/transferagent/wire"
	agentv1 "github.com/kvhandoff/kvhandoff/transferagent/api/v1"
	"github.com/kvhandoff/kvhandoff/transferagent/client"
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
	refused(t, "empty engine id", reg(&agentv1.RegisterEngineRequest{Role: agentv1.Role_ROLE_DECODE, Mode: agentv1.Mode_MODE_PUSH,
		TpSize: 1, Layout: layout}), codes.InvalidArgument, "engine_id")
	refused(t, "rank past size", reg(&agentv1.RegisterEngineRequest{EngineId: "e", Role: agentv1.Role_ROLE_DECODE,
		Mode: agentv1.Mode_MODE_PUSH, TpRank: 2, TpSize: 2, Layout: layout}), codes.InvalidArgument, "tp_rank")
	refused(t, "heads that do not split", reg(&agentv1.RegisterEngineRequest{EngineId: "e", Role: agentv1.Role_ROLE_DECODE,
		Mode: agentv1.Mode_MODE_PUSH, TpSize: 3, Layout: layout}), codes.InvalidArgument, "layout.kv_heads")

	e, err := cl.RegisterEngine(bg, &agentv1.RegisterEngineRequest{EngineId: "bad-input", Role: agentv1.Role_ROLE_DECODE,
		Mode: agentv1.Mode_MODE_PUSH, TpSize: 1, Layout: layout})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	memsock := agentv1.MemorySocket(p.B.Socket)
	fd, mem, err := client.NewMemory("bad-input", 1<<16)
	if err != nil {
		t.Fatal(err)
	}
	defer syscall.Munmap(mem)
	defer syscall.Close(fd)
	register := func(id uint32, handle uint64, off, size uint64, kind agentv1.MemoryKind) error {
		_, err := api.RegisterRegion(bg, &agentv1.RegisterRegionRequest{Session: e.Session, RegionId: id, Kind: kind,
			MemoryHandle: handle, Offset: off, Size: size, BlockLen: 1024, BlockCount: 16})
		return err
	}
	pass := func(session string, fd int) uint64 {
		t.Helper()
		h, err := client.PassMemory(memsock, session, fd)
		if err != nil {
			t.Fatal(err)
		}
		return h
	}
	region := func(id uint32, off, size uint64, kind agentv1.MemoryKind) error {
		return register(id, pass(e.Session, fd), off, size, kind)
	}
	host := agentv1.MemoryKind_MEMORY_KIND_HOST

	// The memory socket takes only sealed memfds, one per packet, for a live session.
	plain, err := os.Create(filepath.Join(t.TempDir(), "plain.kv"))
	if err != nil {
		t.Fatal(err)
	}
	defer plain.Close()
	unsealed, err := unix.MemfdCreate("unsealed", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(unsealed)
	memRefused := func(what string, err error, mentions string) {
		t.Helper()
		if err == nil || !strings.Contains(err.Error(), mentions) {
			t.Errorf("%s: %v, want an error mentioning %q", what, err, mentions)
		}
	}
	second := func(_ uint64, err error) error { return err }
	memRefused("a regular file", second(client.PassMemory(memsock, e.Session, int(plain.Fd()))), "memfd")
	memRefused("an unsealed memfd", second(client.PassMemory(memsock, e.Session, unsealed)), "F_SEAL_SHRINK")
	memRefused("an unknown session", second(client.PassMemory(memsock, "nope", fd)), "session")
	memRefused("a packet without an fd", func() error {
		c, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: memsock, Net: "unixpacket"})
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		if _, err := c.Write([]byte(e.Session)); err != nil {
			t.Fatal(err)
		}
		buf := make([]byte, 256)
		n, err := c.Read(buf)
		if err != nil {
			t.Fatal(err)
		}
		_, err = agentv1.ParseMemoryAnswer(buf[:n])
		return err
	}(), "exactly one fd")
	refused(t, "a handle never passed", register(0, 12345, 0, 16<<10, host), codes.InvalidArgument, "memory_handle")
	// A GPU allocation's packet names its size, and its fd must be one the CUDA driver
	// made: a memfd is refused (here, where no driver is, as such; on a GPU host by the
	// driver), and a memfd's handle names no GPU allocation.
	memRefused("a GPU allocation without its size", second(client.PassCUDA(memsock, e.Session+" x", fd, 0)), agentv1.CUDAPrefix)
	memRefused("a GPU allocation of an unknown session", second(client.PassCUDA(memsock, "nope", fd, 1<<21)), "session")
	memRefused("a memfd passed as a GPU allocation", second(client.PassCUDA(memsock, e.Session, fd, 1<<21)), "cuda")
	refused(t, "a memfd's handle as GPU memory", register(0, pass(e.Session, fd), 0, 16<<10, agentv1.MemoryKind_MEMORY_KIND_CUDA),
		codes.InvalidArgument, "names no GPU allocation")

	refused(t, "a region past the memfd's end", region(0, 60<<10, 16<<10, host), codes.InvalidArgument, "size")
	refused(t, "blocks that do not fit the size", region(0, 0, 8<<10, host), codes.InvalidArgument, "size")
	refused(t, "device memory without FI_MR_DMABUF", region(0, 0, 16<<10, agentv1.MemoryKind_MEMORY_KIND_NEURON), codes.FailedPrecondition, "FI_MR_DMABUF")
	gpuRegion := func(handle, uuid []byte) error {
		_, err := api.RegisterRegion(bg, &agentv1.RegisterRegionRequest{Session: e.Session, Kind: agentv1.MemoryKind_MEMORY_KIND_CUDA,
			CudaIpcHandle: handle, CudaDeviceUuid: uuid, Size: 16 << 10, BlockLen: 1024, BlockCount: 16})
		return err
	}
	refused(t, "a short CUDA IPC handle", gpuRegion(make([]byte, 63), make([]byte, 16)), codes.InvalidArgument, "cuda_ipc_handle")
	refused(t, "a short GPU UUID", gpuRegion(make([]byte, 64), make([]byte, 4)), codes.InvalidArgument, "cuda_device_uuid")
	h := pass(e.Session, fd)
	if err := register(0, h, 0, 16<<10, host); err != nil {
		t.Fatal(err)
	}
	refused(t, "a handle used twice", register(1, h, 32<<10, 16<<10, host), codes.InvalidArgument, "memory_handle")
	refused(t, "a duplicate region id", region(0, 32<<10, 16<<10, host), codes.AlreadyExists, "region_id")
	refused(t, "an overlapping region", region(1, 8<<10, 16<<10, host), codes.AlreadyExists, "overlap")
	// Another engine naming the same memory (it got hold of the memfd) is refused too.
	refused(t, "another engine's memory", func() error {
		other, err := cl.RegisterEngine(bg, &agentv1.RegisterEngineRequest{EngineId: "thief", Role: agentv1.Role_ROLE_DECODE,
			Mode: agentv1.Mode_MODE_PUSH, TpSize: 1, Layout: layout})
		if err != nil {
			t.Fatal(err)
		}
		defer other.Close()
		_, err = api.RegisterRegion(bg, &agentv1.RegisterRegionRequest{Session: other.Session, RegionId: 0, Kind: host,
			MemoryHandle: pass(other.Session, fd), Offset: 0, Size: 16 << 10, BlockLen: 1024, BlockCount: 16})
		return err
	}(), codes.AlreadyExists, "overlap")

	src := p.P[0].Self
	dest := func(req string, blocks []uint32, source *agentv1.EngineRef) error {
		_, err := api.RegisterDestination(bg, &agentv1.RegisterDestinationRequest{Session: e.Session, RequestId: req, Attempt: 1,
			BlockIds: blocks, Source: source})
		return err
	}
	refused(t, "a block outside the region", dest("r", []uint32{3, 16}, src), codes.InvalidArgument, "block_ids[1]")
	refused(t, "no blocks", dest("r", nil, src), codes.InvalidArgument, "block_ids")
	refused(t, "no request id", dest("", []uint32{1}, src), codes.InvalidArgument, "request_id")
	refused(t, "a source of another rank", dest("r", []uint32{1}, &agentv1.EngineRef{Agent: src.Agent, EngineId: src.EngineId,
		TpRank: 1}), codes.InvalidArgument, "source.tp_rank")
	refused(t, "a source of a size the heads do not map onto", dest("r", []uint32{1}, &agentv1.EngineRef{Agent: src.Agent,
		EngineId: src.EngineId, TpSize: 3}), codes.InvalidArgument, "source.tp_size")
	refused(t, "a source of another size for KV that is not head-major", dest("r", []uint32{1}, &agentv1.EngineRef{Agent: src.Agent,
		EngineId: src.EngineId, TpSize: 2}), codes.InvalidArgument, "head_major")
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
	refused(t, "regions added after the first transfer", region(2, 32<<10, 16<<10, host), codes.FailedPrecondition, "fixed")

	// Prefill side: a position reported twice, a block outside the regions.
	ready := func(off uint32, blocks []uint32) error { return p.P[0].SourceReady(bg, "twice", off, blocks, false) }
	if err := ready(0, []uint32{1, 2}); err != nil {
		t.Fatal(err)
	}
	refused(t, "a position reported twice", ready(1, []uint32{3}), codes.InvalidArgument, "twice")
	refused(t, "a source block outside the regions", ready(2, []uint32{64}), codes.InvalidArgument, "block_ids[0]")
	refused(t, "positions beyond the engine's blocks", ready(1<<31, []uint32{3}), codes.InvalidArgument, "offset: positions 2147483648..2147483649")

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
	c.SetReadDeadline(time.Now().Add(4 * time.Second)) // inside the 5 s handshake timeout
	r := bufio.NewReader(c)
	if _, err := wire.Read(r); err != nil { // the agent's own Hello
		t.Fatal(err)
	}
	if _, err := wire.Read(r); !errors.Is(err, io.EOF) {
		t.Errorf("after a 1 MiB frame header the agent did not close the connection at once (%v): it waits to read the body", err)
	}
	c.Close()

	// Connections that never finish a handshake: beyond the cap each newcomer evicts the
	// oldest.
	const flood = 100
	var conns []net.Conn
	for range flood {
		c, err := net.Dial("tcp", p.A.Peer)
		if err != nil {
			t.Fatal(err)
		}
		conns = append(conns, c)
	}
	until(t, "the connections past the cap are evicted", func() bool {
		return p.A.Metric(t, `kvhandoff_agent_refused_total{call="peer",code="ResourceExhausted"}`) == flood-maxHandshakesForTest
	})
	for _, c := range conns {
		c.Close()
	}
	// The agent lets go of the closed connections as it reads their end; a peer that
	// dials before then may still find the handshake slots full.
	until(t, "the flood's connections are released", func() bool {
		return p.A.Metric(t, "kvhandoff_agent_peer_connections") == 0
	})
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
	victim := &agentv1.RegisterEngineRequest{EngineId: p.P[0].Self.EngineId, Role: agentv1.Role_ROLE_PREFILL,
		Mode: agentv1.Mode_MODE_PUSH, TpSize: 1, Layout: layout}
	_, err = cl.API.RegisterEngine(bg, victim)
	refused(t, "registering a live engine's id", err, codes.AlreadyExists, "live session")
	transfer(t, p.P[0], p.D[0], "after-the-eviction-attempt")

	// A registration that never opens its event stream is closed after the deadline.
	if _, err := cl.API.RegisterEngine(bg, &agentv1.RegisterEngineRequest{EngineId: "never-listens", Role: agentv1.Role_ROLE_DECODE,
		Mode: agentv1.Mode_MODE_PUSH, TpSize: 1, Layout: layout}); err != nil {
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

// With --socket-gid, engines of that group (not root) can use both sockets, and can
// neither remove nor create anything in their folder: no engine can replace a socket.
func TestTheSocketGroupReachesBothSocketsAndCannotReplaceThem(t *testing.T) {
	a := startAgent(t, "grouped", t.TempDir(), "--socket-gid", "7470")
	want := map[string]os.FileMode{a.Socket: 0o660, agentv1.MemorySocket(a.Socket): 0o660, filepath.Dir(a.Socket): 0o750}
	for path, mode := range want {
		st, err := os.Stat(path)
		if err != nil {
			t.Fatal(err)
		}
		if gid := st.Sys().(*syscall.Stat_t).Gid; gid != 7470 {
			t.Errorf("%s belongs to group %d, want 7470", path, gid)
		}
		if got := st.Mode() & os.ModePerm; got != mode {
			t.Errorf("%s has mode %v, want %v", path, got, mode)
		}
	}
}

// An engine must not be able to shrink memory the agent has mapped: the provider copies
// into decode memory inside the agent, and a truncated file killed the decode agent with
// SIGBUS (tcp;ofi_rxm) or stalled the transfer (shm). Only sealed memfds are taken, and a
// sealed memfd cannot shrink.
func TestMemoryAnEngineCouldShrinkIsRefused(t *testing.T) {
	a := startAgent(t, "seals", t.TempDir())
	e := bareEngine(t, a, "shrinker", agentv1.Role_ROLE_DECODE)
	// Sealed against growing only: it could still shrink.
	fd, err := unix.MemfdCreate("grow-sealed", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	if err := unix.Ftruncate(fd, 1<<16); err != nil {
		t.Fatal(err)
	}
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, unix.F_SEAL_GROW); err != nil {
		t.Fatal(err)
	}
	if _, err := client.PassMemory(agentv1.MemorySocket(a.Socket), e.Session, fd); err == nil || !strings.Contains(err.Error(), "F_SEAL_SHRINK") {
		t.Fatalf("a memfd that can shrink: %v, want a refusal naming F_SEAL_SHRINK", err)
	}
	// What engines use: the agent maps it, and the engine cannot shrink it afterwards.
	sealed, mem, err := client.NewMemory("sealed", 1<<16)
	if err != nil {
		t.Fatal(err)
	}
	defer syscall.Munmap(mem)
	defer unix.Close(sealed)
	if err := e.RegisterRegion(bg, client.Region{ID: 0, FD: sealed, Size: 1 << 16, BlockLen: 1024, BlockCount: 64}); err != nil {
		t.Fatal(err)
	}
	if err := unix.Ftruncate(sealed, 0); !errors.Is(err, unix.EPERM) {
		t.Fatalf("truncating the registered memfd: %v, want EPERM", err)
	}
}

// The attack: the seals that keep a memfd from shrinking still let its engine punch
// holes in it after passing it (its RSS 140 → 12 MB), and the agent's next transfer
// faulted the pages back in, charged to the agent (RssShmem 0 → 128 MB). The agent looks
// at its sessions' memfds at each watchdog tick and ends the session whose memory lost
// pages, saying why; the pages are not faulted back in.
func TestAnEngineThatPunchesAHoleInItsMemoryLosesItsSession(t *testing.T) {
	a := startAgent(t, "holes", t.TempDir())
	e := bareEngine(t, a, "puncher", agentv1.Role_ROLE_DECODE)
	fd, mem, err := client.NewMemory("kv", 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	defer syscall.Munmap(mem)
	defer unix.Close(fd)
	if err := e.RegisterRegion(bg, client.Region{ID: 0, FD: fd, Size: 1 << 20, BlockLen: 4096, BlockCount: 256}); err != nil {
		t.Fatal(err)
	}
	if err := unix.Fallocate(fd, unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, 0, 1<<19); err != nil {
		t.Fatal(err)
	}
	until(t, "the session ends", func() bool { return e.Err() != nil })
	if err := e.Err(); err == nil || !strings.Contains(err.Error(), "punched hole") {
		t.Fatalf("the session ended with %v; want it to say the engine punched a hole", err)
	}
	if n := a.Metric(t, `kvhandoff_agent_refused_total{call="memory",code="FailedPrecondition"}`); n != 1 {
		t.Errorf("sessions ended for memory that shrank: %v, want 1", n)
	}
	until(t, "the session is gone", func() bool { return a.Metric(t, "kvhandoff_agent_engine_sessions") == 0 })
}

// The attack: SourceReady parts of one block at offset 2^19-1 (48 bytes each) made the
// agent hold 2^19 positions apiece: 100 of them grew its heap by 424 MB, held for the
// engine's blocks TTL. A rank's requests hold at most 2^19 positions in all: the parts
// past that are refused, naming the field, and the heap stays small.
func TestFarOffsetsCannotMakeTheAgentHoldMemory(t *testing.T) {
	a := startAgent(t, "offsets", t.TempDir())
	e := bareEngine(t, a, "far", agentv1.Role_ROLE_PREFILL)
	const blocks = 1 << 20 // one byte each: the positions an offset may name
	fd, mem, err := client.NewMemory("kv", blocks)
	if err != nil {
		t.Fatal(err)
	}
	defer syscall.Munmap(mem)
	defer unix.Close(fd)
	if err := e.RegisterRegion(bg, client.Region{ID: 0, FD: fd, Size: blocks, BlockLen: 1, BlockCount: blocks}); err != nil {
		t.Fatal(err)
	}
	heap := func() float64 { return a.Metric(t, "go_memstats_heap_inuse_bytes") / (1 << 20) }
	before := heap()
	accepted := 0
	var refusal error
	for i := range 100 {
		err := e.SourceReady(bg, fmt.Sprintf("far-%d", i), 1<<19-1, []uint32{uint32(i)}, true)
		if err == nil {
			accepted++
			continue
		}
		refusal = err
	}
	if accepted != 1 || status.Code(refusal) != codes.ResourceExhausted || !strings.Contains(refusal.Error(), "offset") {
		t.Errorf("%d of 100 far parts accepted, the others refused with %v; want 1, then ResourceExhausted naming offset", accepted, refusal)
	}
	if grew := heap() - before; grew > 64 {
		t.Errorf("the agent's heap grew by %.0f MB; want at most 64 (the bound: 2^19 positions)", grew)
	}
}
