package session

import (
	"fmt"
	"os"
	"runtime"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kvhandoff/kvhandoff/internal/transferagent/cudaipc"
	"github.com/kvhandoff/kvhandoff/internal/transferagent/fabric"
	"github.com/kvhandoff/kvhandoff/internal/transferagent/mesh"
	"github.com/kvhandoff/kvhandoff/internal/transferagent/wire"
	"github.com/kvhandoff/kvhandoff/internal/transferagent/writer"
	agentv1 "github.com/kvhandoff/kvhandoff/transferagent/api/v1"
)

// Session is one engine rank's connection to the agent. It owns the rank's fabric
// endpoint, and one goroutine (run, the "pump") owns all of its state: engine calls and
// peer messages reach it as closures on cmds, so no lock guards the transfer state and
// the fabric is only touched from one thread, as libfabric's RDM endpoints expect.
type Session struct {
	n   *node
	id  string
	key string // engine id/rank
	// owner is the pod (or, outside pods, the user) that registered the session; only it
	// may make calls naming the session (package engineapi, identity.go).
	owner string
	epoch uint64
	role  agentv1.Role
	mode  agentv1.Mode
	rank  uint32
	// tpSize and kvHeads are the engine's tensor-parallel size and its model's KV heads;
	// heads are those this rank holds, and headMajor says its blocks hold them one after
	// another (KVLayout.head_major).
	tpSize, kvHeads uint32
	heads           agentv1.Heads
	headMajor       bool
	ep              *fabric.Endpoint
	// pol is the engine's policy's timeouts (RegisterEngine), the agent's flags where
	// it sent none.
	pol Timeouts

	cmds     chan func()
	sleeping atomic.Bool // the pump is (about to be) blocked in the endpoint's Wait
	events   chan *agentv1.Event
	attached atomic.Bool
	// streamDeadline closes a session whose engine opens no event stream in time.
	streamDeadline *time.Timer
	closing        chan struct{}
	stopped        chan struct{}
	once           sync.Once
	reasonMu       sync.Mutex
	reason         string

	// fds are memfds passed over the memory socket, by handle, until a RegisterRegion
	// claims them (nil once the session ended); passed are GPU allocations passed there,
	// by handle, held until the session ends. Their handles are numbered together.
	fdMu   sync.Mutex
	fds    map[uint64]*os.File
	passed map[uint64]passedGPU
	nextFD uint64

	// Everything below belongs to the pump.
	side      side
	regions   map[uint32]*localRegion
	layout    []writer.Region
	minBlocks uint32
	blockLen  uint64 // bytes one block id spans across all regions
	frozen    bool
	buf       []fabric.Completion
	lastTick  time.Time
	heldCount int                      // what countHeld last added to held
	held      prometheus.Gauge         // kvhandoff_agent_held_requests of the session's role
	remotes   map[string]*remoteEngine // peer engines' memory as reached, by engine key
	retired   []*remoteEngine          // older epochs' that hold GPU allocations open
	gpu       *sessionGPU              // nil unless the regions are GPU memory
	railBytes []uint64                 // RailBytes already counted in the metric
	// hostBytes is the host memory its regions map; files the memfds they map, one
	// descriptor per file, kept to see that their pages stay (checkFiles).
	hostBytes uint64
	files     map[fileID]*os.File
}

// side is what a session does for its role: prefillSide (a source: push writes, pull
// holds) or decodeSide (a destination: push landings, pull reads). The session is the
// driver both share: the pump, the endpoint, the regions.
type side interface {
	access() fabric.Access // how peers may use this rank's memory
	freeze()               // the regions are fixed: build what needs them
	step(now time.Time) bool
	absorb([]fabric.Completion) // completions a Wait read, for the next step
	hot() bool                  // data moving: poll without pause
	warm() bool                 // something may arrive: poll with a backoff
	watchdog(now time.Time)
	cancel(now time.Time, req string, attempt uint64) error
	peerLost(now time.Time, p *mesh.Peer)
	fenceAll(now time.Time, reason string)
	drained() bool
	// held is how many requests the rank's side keeps state for: sources, registrations,
	// pulls. Idle, it is 0; what stays is a leak (kvhandoff_agent_held_requests).
	held() int
}

type localRegion struct {
	id       uint32
	m        *mapping
	reg      *fabric.Region  // host memory: registered on the endpoint
	dev      *cudaipc.Region // GPU memory: opened from its IPC handle
	blockLen uint64
	blocks   uint32
}

// remoteEngine is a peer engine's memory as this rank reaches it, worked out once per
// epoch of that engine: its regions as the planner sees them, and by ID with what reaches
// them — fabric addresses and keys through peer, or for GPU memory on this node device
// addresses in this rank's GPU context (onGPU), from the allocations it opened.
type remoteEngine struct {
	epoch   uint64
	regions []writer.Region
	byID    map[int]writer.RemoteRegion
	heads   *wire.Heads // nil: an agent from before heads, whose engines pair rank with rank
	onGPU   bool
	peer    fabric.Peer
	opened  []cudaipc.Key
}

func newSession(n *node, fallback Timeouts, id, key, owner string, epoch uint64, r *agentv1.RegisterEngineRequest, ep *fabric.Endpoint) *Session {
	s := &Session{
		n: n, id: id, key: key, owner: owner, epoch: epoch, role: r.Role, mode: r.Mode, rank: r.TpRank, ep: ep,
		tpSize: r.TpSize, kvHeads: r.GetLayout().GetKvHeads(), headMajor: r.GetLayout().GetHeadMajor(),
		pol:  RequestTimeouts(r).Complete(fallback),
		cmds: make(chan func(), 1024), events: make(chan *agentv1.Event, 1<<16),
		closing: make(chan struct{}), stopped: make(chan struct{}),
		regions: map[uint32]*localRegion{}, buf: make([]fabric.Completion, 64), remotes: map[string]*remoteEngine{},
		fds: map[uint64]*os.File{}, passed: map[uint64]passedGPU{}, files: map[fileID]*os.File{},
		held: n.metrics.held.WithLabelValues(roleLabel(r.Role)),
	}
	if agentv1.CheckShards(s.kvHeads, s.tpSize) == nil { // RegisterEngine checked it; tests of the table alone send no layout
		s.heads = agentv1.RankHeads(s.kvHeads, s.tpSize, s.rank)
	}
	if r.Role == agentv1.Role_ROLE_PREFILL {
		s.side = newPrefillSide(s)
	} else {
		s.side = newDecodeSide(s)
	}
	return s
}

// prefill and decode return the session's side of that role, or nil.
func (s *Session) prefill() *prefillSide { ps, _ := s.side.(*prefillSide); return ps }
func (s *Session) decode() *decodeSide   { ds, _ := s.side.(*decodeSide); return ds }

// post runs fn on the pump, unless the session has stopped.
func (s *Session) post(fn func()) {
	select {
	case s.cmds <- fn:
		s.wake()
	case <-s.stopped:
	}
}

// wake ends the pump's Wait on the endpoint, so it runs a command now.
func (s *Session) wake() {
	if s.sleeping.Load() {
		s.ep.Wake()
	}
}

// call runs fn on the pump and returns its error: engine calls get their validation
// errors synchronously, while the fabric work they start runs on after they return.
func (s *Session) call(fn func() error) error {
	done := make(chan error, 1)
	select {
	case s.cmds <- func() { done <- fn() }:
		s.wake()
	case <-s.stopped:
		return status.Error(codes.NotFound, "session ended: "+s.CloseReason())
	}
	select {
	case err := <-done:
		return err
	case <-s.stopped:
		return status.Error(codes.NotFound, "session ended: "+s.CloseReason())
	}
}

// Attach marks the session's event stream open: the first caller gets true.
func (s *Session) Attach() bool {
	if !s.attached.CompareAndSwap(false, true) {
		return false
	}
	s.streamDeadline.Stop()
	return true
}

// ID is the session's id; Epoch the incarnation of the engine rank it serves.
func (s *Session) ID() string    { return s.id }
func (s *Session) Epoch() uint64 { return s.epoch }

// Events are what the session tells its engine, in order.
func (s *Session) Events() <-chan *agentv1.Event { return s.events }

// Stopped is closed once the session has ended and released everything it held.
func (s *Session) Stopped() <-chan struct{} { return s.stopped }

// Ended reports whether the session is closing or closed.
func (s *Session) Ended() bool {
	select {
	case <-s.closing:
		return true
	default:
		return false
	}
}

// Close ends the session: the pump fences what is outstanding, drains, and releases the
// endpoint and memory.
func (s *Session) Close(reason string) {
	s.once.Do(func() {
		s.reasonMu.Lock()
		s.reason = reason
		s.reasonMu.Unlock()
		close(s.closing)
		s.wake()
	})
}

func (s *Session) CloseReason() string {
	s.reasonMu.Lock()
	defer s.reasonMu.Unlock()
	return s.reason
}

func (s *Session) Emit(ev *agentv1.Event) {
	select {
	case s.events <- ev:
	case <-s.closing:
	}
}

// Polling while data moves, on providers without a kernel wait (shm): hotSpins immediate
// polls after the last progress, then naps (which the Go runtime stretches to about 1 ms).
const (
	hotSpins = 16
	hotNap   = 20 * time.Microsecond
)

// run is the pump. It alternates running commands with driving the fabric. When the
// fabric needs driving (transfers in flight, or a peer may be moving data into this
// rank's memory: tcp;ofi_rxm moves data only while the target polls) it waits inside the
// provider where it can, else polls with a backoff; otherwise it sleeps until a command
// or the watchdog's tick. Once the session is closing it fences what is outstanding and
// tears down when that has drained, or a lease after.
func (s *Session) run() {
	defer close(s.stopped)
	p := &pumpState{timer: time.NewTimer(time.Hour)}
	defer p.timer.Stop()
	for {
		worked := s.runCommands()
		now := time.Now()
		if s.side.step(now) {
			worked = true
		}
		if now.Sub(s.lastTick) >= s.pol.Tick {
			s.lastTick = now
			s.side.watchdog(now)
			s.checkFiles()
			s.countRails()
			s.countHeld(s.side.held())
		}
		if !p.closing && s.Ended() {
			p.closing, p.closeDeadline = true, now.Add(s.pol.Lease)
			s.n.log.Info("engine session ending", "engine", s.key, "reason", s.CloseReason())
			s.side.fenceAll(now, s.CloseReason())
			continue
		}
		if p.closing && (s.side.drained() || now.After(p.closeDeadline)) {
			s.teardown()
			return
		}
		if worked {
			p.idle = 0
			runtime.Gosched()
			continue
		}
		p.idle++
		s.await(p)
	}
}

// pumpState is what the pump carries from one turn to the next.
type pumpState struct {
	timer         *time.Timer
	idle          int // turns since the last that did work
	closing       bool
	closeDeadline time.Time
}

// await waits, after a turn that did no work, for the next thing to do: inside the
// provider where it can wait (a completion, data to move, or a command's wake), else
// for a command or a timer whose length says how soon something may move.
func (s *Session) await(p *pumpState) {
	hot := s.side.hot()
	// A rank of GPU memory moves its bytes by copies, which no provider wait notices.
	if (hot || s.side.warm() || p.closing) && s.ep.Waitable() && s.gpu == nil {
		// No spinning, and no sub-millisecond timers, which the Go runtime rounds up to a
		// millisecond.
		timeout := s.pol.Tick
		if hot || p.closing {
			timeout = time.Millisecond
		}
		s.sleeping.Store(true)
		if len(s.cmds) == 0 {
			if n := s.ep.Wait(s.buf, timeout); n > 0 {
				s.side.absorb(s.buf[:n])
			}
		}
		s.sleeping.Store(false)
		return
	}
	switch {
	case hot:
		// Data is moving: poll again at once a few times, then nap, so that many hot
		// ranks sharing few cores leave the cores to the ones moving data. GPU copies
		// take a millisecond or so and use no core: poll them without a nap, which
		// the Go runtime would stretch to about as long as the copies.
		if p.idle < hotSpins || (s.gpu != nil && s.gpu.copier.Busy()) {
			runtime.Gosched()
			return
		}
		p.timer.Reset(hotNap)
	case s.side.warm() || p.closing:
		// Something may arrive: poll, backing off to a millisecond.
		p.timer.Reset(min(time.Duration(p.idle)*10*time.Microsecond, time.Millisecond))
	default:
		p.timer.Reset(s.pol.Tick)
	}
	select {
	case fn := <-s.cmds:
		fn()
		p.idle = 0
	case <-p.timer.C:
	case <-s.closing:
	}
}

func (s *Session) runCommands() bool {
	ran := false
	for {
		select {
		case fn := <-s.cmds:
			fn()
			ran = true
		default:
			return ran
		}
	}
}

func (s *Session) teardown() {
	s.streamDeadline.Stop()
	s.countRails()
	s.ep.Quiesce() // no rail thread moves data into memory unmapped below
	s.dropDeposits()
	s.closeGPU()
	for _, r := range s.regions {
		if r.reg == nil {
			continue
		}
		if err := r.reg.Close(); err != nil {
			s.n.log.Warn("deregistering memory", "engine", s.key, "region", r.id, "err", err)
		}
		r.m.unmap()
	}
	for _, f := range s.files {
		f.Close()
	}
	s.ep.Close()
	s.countHeld(0) // what a session held ends with it: its memory is unmapped above
	s.n.forget(s)
	s.n.log.Info("engine session ended", "engine", s.key, "reason", s.CloseReason())
}

// countHeld moves the agent's held-requests gauge by this session's change to n.
func (s *Session) countHeld(n int) {
	s.held.Add(float64(n - s.heldCount))
	s.heldCount = n
}

// countRails adds what each rail carried since the last count to the rail metric.
func (s *Session) countRails() {
	now := s.ep.RailBytes()
	for i, b := range now {
		var before uint64
		if i < len(s.railBytes) {
			before = s.railBytes[i]
		}
		if b > before {
			s.n.metrics.rails.WithLabelValues(strconv.Itoa(i)).Add(float64(b - before))
		}
	}
	s.railBytes = now
}

// checkFiles ends the session if its engine punched a hole in memory it passed: at each
// watchdog tick, so a hole is found within a tick (100 ms at most).
func (s *Session) checkFiles() {
	for _, f := range s.files {
		missing, err := allocated(f)
		if err == nil && missing == 0 {
			continue
		}
		if s.Ended() {
			return
		}
		reason := fmt.Sprintf("memory_handle: %d bytes of a memfd the engine passed are no longer allocated (a punched hole); "+
			"the agent does not fault in an engine's memory", missing)
		if err != nil {
			reason = fmt.Sprintf("memory_handle: checking a memfd the engine passed: %v", err)
		}
		s.n.metrics.Refused.WithLabelValues("memory", codes.FailedPrecondition.String()).Inc()
		s.n.log.Warn("ending a session whose memory shrank", "engine", s.key, "reason", reason)
		s.Close(reason)
		return
	}
}

// addRegion registers a region on the rank's endpoint, with the access the side allows
// peers (never both reading and writing a rank's memory), and keeps f, the memfd it maps
// (one descriptor per file; f is closed if the session has one already).
func (s *Session) addRegion(r *agentv1.RegisterRegionRequest, m *mapping, f *os.File) error {
	if s.frozen {
		return status.Error(codes.FailedPrecondition, "region_id: regions are fixed once the engine's first transfer started")
	}
	if s.gpu != nil {
		return status.Error(codes.FailedPrecondition, "kind: an engine rank's regions must all be host memory or all on one GPU")
	}
	if s.hostBytes+uint64(len(m.mem)) > maxSessionBytes {
		return status.Errorf(codes.ResourceExhausted, "size: the rank's regions would map %d bytes, over the agent's %d per engine rank",
			s.hostBytes+uint64(len(m.mem)), uint64(maxSessionBytes))
	}
	reg, err := s.ep.Register(m.mem, s.side.access())
	if err != nil {
		return status.Errorf(codes.Internal, "registering region %d: %v", r.RegionId, err)
	}
	s.hostBytes += uint64(len(m.mem))
	if _, ok := s.files[m.file]; ok {
		f.Close()
	} else {
		s.files[m.file] = f
	}
	s.track(r, &localRegion{id: r.RegionId, m: m, reg: reg, blockLen: r.BlockLen, blocks: r.BlockCount})
	return nil
}

// maxSessionBytes bounds the host memory one engine rank registers: the engine pays for
// its memory, but the page tables that map it into the agent are the agent's (2 MiB per
// GiB), so no engine can make them exhaust the agent's memory.
const maxSessionBytes = 1 << 40

// track adds a registered region to the rank's layout.
func (s *Session) track(r *agentv1.RegisterRegionRequest, l *localRegion) {
	s.regions[r.RegionId] = l
	s.layout = append(s.layout, writer.Region{ID: int(r.RegionId), BlockLen: r.BlockLen, Blocks: r.BlockCount})
	slices.SortFunc(s.layout, func(a, b writer.Region) int { return a.ID - b.ID })
	if s.minBlocks == 0 || r.BlockCount < s.minBlocks {
		s.minBlocks = r.BlockCount
	}
	s.blockLen += r.BlockLen
}

// freeze fixes the regions at the first transfer: peers are told about them once.
func (s *Session) freeze() error {
	if len(s.regions) == 0 {
		return status.Error(codes.FailedPrecondition, "session: register the engine's KV regions before its first transfer")
	}
	if !s.frozen {
		s.frozen = true
		s.side.freeze()
	}
	return nil
}

// checkBlocks refuses block ids outside the engine's regions.
func (s *Session) checkBlocks(field string, ids []uint32) error {
	for i, b := range ids {
		if b >= s.minBlocks {
			return status.Errorf(codes.InvalidArgument, "%s[%d]: block %d is outside the registered regions (%d blocks)", field, i, b, s.minBlocks)
		}
	}
	return nil
}

// bytesFor is what a request of n blocks moves on this rank.
func (s *Session) bytesFor(n int) uint64 { return s.blockLen * uint64(n) }

// describe is what tells a peer how to reach the rank's memory: its EngineInfo (rail 0),
// then, when the rank has more rails, their addresses and keys, and when its memory is on
// a GPU, that (with the IPC handles for a peer within this agent).
func (s *Session) describe(local bool) []wire.Message {
	addrs, err := s.ep.Addresses()
	if err != nil {
		s.n.log.Error("reading the endpoint's addresses", "engine", s.key, "err", err)
		addrs = make([][]byte, s.ep.Rails())
	}
	m := &wire.EngineInfo{Engine: s.key, Epoch: s.epoch, Address: string(addrs[0])}
	rails := &wire.Rails{Engine: s.key, Epoch: s.epoch, Rails: make([]wire.Rail, len(addrs)-1)}
	for i := range rails.Rails {
		rails.Rails[i].Address = string(addrs[i+1])
	}
	for _, l := range s.layout {
		r := s.regions[uint32(l.ID)]
		ri := wire.RegionInfo{ID: uint64(r.id), BlockLen: r.blockLen, Blocks: uint64(r.blocks)}
		if r.reg != nil { // host memory; GPU memory is what the GPU message describes
			ri.Addr, ri.Key = r.reg.RemoteAddr(0), r.reg.Keys[0]
			for i := range rails.Rails {
				rails.Rails[i].Keys = append(rails.Rails[i].Keys, r.reg.Keys[i+1])
			}
		}
		m.Regions = append(m.Regions, ri)
	}
	out := []wire.Message{m}
	switch {
	case s.gpu != nil:
		out = append(out, s.gpuInfo(local))
	case len(rails.Rails) > 0:
		out = append(out, rails)
	}
	if h := s.describeHeads(); h != nil {
		out = append(out, h)
	}
	return out
}

// describeHeads is the Heads message of this rank: none unless the engine said its KV is
// head-major and every region's blocks are of one length that its heads share evenly
// (a layout the agent can slice); peers then pair it only with ranks holding its heads.
func (s *Session) describeHeads() *wire.Heads {
	if !s.headMajor || len(s.layout) == 0 || s.heads.Count == 0 {
		return nil
	}
	bl := s.layout[0].BlockLen
	for _, l := range s.layout {
		if l.BlockLen != bl || bl%uint64(s.heads.Count) != 0 {
			return nil
		}
	}
	return &wire.Heads{Engine: s.key, Epoch: s.epoch, First: uint64(s.heads.First), Count: uint64(s.heads.Count), HeadBytes: bl / uint64(s.heads.Count)}
}

// slice is the part of each block moved between this rank and a remote one (source:
// the remote rank is the source, as in a pull): the zero Slice when they hold the same
// heads. Ranks of different heads need both described as head-major with heads of one
// size.
func (s *Session) slice(re *remoteEngine, source bool) (writer.Slice, error) {
	mine := s.describeHeads()
	if re.heads == nil || mine == nil {
		if re.heads != nil && (re.heads.First != uint64(s.heads.First) || re.heads.Count != uint64(s.heads.Count)) {
			return writer.Slice{}, fmt.Errorf("it holds KV heads [%d,%d) and this rank %s, whose KV is not head-major (KVLayout.head_major): "+
				"only engines of the same tensor-parallel size pair with it", re.heads.First, re.heads.First+re.heads.Count, s.heads)
		}
		return writer.Slice{}, nil // equal ranks, or a rank that cannot say otherwise: whole blocks, checked against each other
	}
	if re.heads.HeadBytes != mine.HeadBytes {
		return writer.Slice{}, fmt.Errorf("its KV heads are %d bytes of a block and this rank's %d: the layouts differ", re.heads.HeadBytes, mine.HeadBytes)
	}
	theirs := agentv1.Heads{First: uint32(re.heads.First), Count: uint32(re.heads.Count)}
	src, dst := s.heads, theirs
	if source {
		src, dst = theirs, s.heads
	}
	return writer.HeadSlice(src, dst, mine.HeadBytes)
}

// reach is how this rank reaches a remote engine's memory, described by info on
// connection p: worked out on the first transfer with that engine's epoch (the fabric
// peer inserted, or its GPU allocations opened) and kept for the next ones. A newer epoch
// replaces the older one's; what that opened stays open until teardown, since copies of
// the older epoch's fenced attempts may still be draining into it.
func (s *Session) reach(p *mesh.Peer, info *wire.EngineInfo) (*remoteEngine, error) {
	old := s.remotes[info.Engine]
	if old != nil && old.epoch == info.Epoch {
		return old, nil
	}
	r := &remoteEngine{epoch: info.Epoch, regions: make([]writer.Region, len(info.Regions)), byID: make(map[int]writer.RemoteRegion, len(info.Regions)),
		heads: info.Heads}
	for i, ri := range info.Regions {
		r.regions[i] = writer.Region{ID: int(ri.ID), BlockLen: ri.BlockLen, Blocks: uint32(min(ri.Blocks, 1<<32-1))}
		r.byID[int(ri.ID)] = writer.RemoteRegion{Region: r.regions[i], Addr: ri.Addr, Keys: info.Keys(i)}
	}
	var err error
	if info.GPU != nil || s.gpu != nil {
		err = s.openPeerGPU(p, info, r)
	} else {
		r.peer, err = s.ep.AddPeer(info.Addresses()...)
	}
	if err != nil {
		return nil, err
	}
	if old != nil && len(old.opened) > 0 {
		s.retired = append(s.retired, old)
	}
	s.remotes[info.Engine] = r
	return r, nil
}
