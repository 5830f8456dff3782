package fabric

import (
	"bytes"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"
)

// pair opens two endpoints of provider that know each other, as a prefill agent and a
// decode agent would after their address exchange.
func pair(t *testing.T, provider string) (src, dst *Endpoint, peer Peer) {
	t.Helper()
	var err error
	if src, err = Open(provider); err != nil {
		t.Fatalf("opening %s: %v", provider, err)
	}
	t.Cleanup(src.Close)
	if dst, err = Open(provider); err != nil {
		t.Fatalf("opening %s: %v", provider, err)
	}
	t.Cleanup(dst.Close)
	addr, err := dst.Address()
	if err != nil {
		t.Fatal(err)
	}
	if peer, err = src.AddPeer(addr); err != nil {
		t.Fatal(err)
	}
	return src, dst, peer
}

func region(t *testing.T, e *Endpoint, size int, access Access) (Memory, *Region) {
	t.Helper()
	mem, err := Alloc(size)
	if err != nil {
		t.Fatal(err)
	}
	r, err := e.Register(mem, access)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		e.Quiesce()
		if err := r.Close(); err != nil {
			t.Error(err)
		}
		_ = mem.Free()
	})
	return mem, r
}

// link drives two endpoints the way an agent's writer does: every completion either side
// reports is kept, and posts that meet ErrAgain are retried while both sides poll.
type link struct {
	t        *testing.T
	src, dst *Endpoint
	s, d     []Completion
}

func (l *link) poll() {
	buf := make([]Completion, 16)
	n := l.src.Poll(buf)
	l.s = append(l.s, buf[:n]...)
	n = l.dst.Poll(buf)
	l.d = append(l.d, buf[:n]...)
	for _, c := range append(l.s, l.d...) {
		if c.Err != nil {
			l.t.Fatal(c.Err)
		}
	}
}

func (l *link) post(op func() error) {
	for {
		err := op()
		if err == nil {
			return
		}
		if err != ErrAgain {
			l.t.Fatal(err)
		}
		l.poll()
	}
}

// writeAll writes size bytes of region s into the peer's region d in piece-byte writes
// (ids 1, 2, …) and waits for their completions.
func (l *link) writeAll(peer Peer, s, d *Region, size, piece uint64) {
	for off := uint64(0); off < size; off += piece {
		l.post(func() error { return l.src.Write(peer, s, off, piece, d.RemoteAddr(off), d.Keys, off/piece+1) })
	}
	l.until("the writes' completions", func() bool { return uint64(len(l.s)) == size/piece })
}

// until polls until cond holds, failing after a deadline instead of hanging.
func (l *link) until(what string, cond func() bool) {
	deadline := time.Now().Add(60 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			l.t.Fatalf("no progress waiting for %s: %d source and %d target completions", what, len(l.s), len(l.d))
		}
		l.poll()
	}
}

func TestWriteThenSignalDeliversEveryByte(t *testing.T) {
	for _, provider := range []string{"tcp;ofi_rxm", "shm"} {
		t.Run(provider, func(t *testing.T) {
			src, dst, peer := pair(t, provider)
			if got := src.Limits().Provider; got != provider {
				t.Fatalf("asked for %s, got %s", provider, got)
			}
			const size, piece = 64 << 20, 4 << 20
			from, srcRegion := region(t, src, size, Source)
			to, dstRegion := region(t, dst, size, Target)
			for i := range from {
				from[i] = byte(i*7 + i>>16)
			}
			l := &link{t: t, src: src, dst: dst}
			l.writeAll(peer, srcRegion, dstRegion, size, piece)
			for i, c := range l.s {
				if c.Remote || c.ID == 0 {
					t.Fatalf("source completion %d is %+v", i, c)
				}
			}

			l.post(func() error { return src.WriteData(peer, 42, dstRegion.RemoteAddr(0), dstRegion.Keys, 1000) })
			l.until("the signal at the target", func() bool { return len(l.d) > 0 })
			if c := l.d[0]; !c.Remote || c.Data != 42 {
				t.Fatalf("target completion %+v, want remote data 42", c)
			}
			if !bytes.Equal(from, to) {
				t.Fatal("the target's memory differs from the source after the signal arrived")
			}
		})
	}
}

// railPair opens two endpoints of srcRails and dstRails rails that know each other.
func railPair(t *testing.T, provider string, srcRails, dstRails int) (src, dst *Endpoint, peer Peer) {
	t.Helper()
	return connect(t, func() (*Endpoint, error) { return OpenRails(provider, srcRails) }, func() (*Endpoint, error) { return OpenRails(provider, dstRails) })
}

// connect opens a source and a destination endpoint and makes the destination the
// source's peer.
func connect(t *testing.T, openSrc, openDst func() (*Endpoint, error)) (src, dst *Endpoint, peer Peer) {
	t.Helper()
	var err error
	if src, err = openSrc(); err != nil {
		t.Fatalf("opening the source: %v", err)
	}
	t.Cleanup(src.Close)
	if dst, err = openDst(); err != nil {
		t.Fatalf("opening the destination: %v", err)
	}
	t.Cleanup(dst.Close)
	addrs, err := dst.Addresses()
	if err != nil {
		t.Fatal(err)
	}
	if len(addrs) != dst.Rails() {
		t.Fatalf("%d addresses for %d rails", len(addrs), dst.Rails())
	}
	if peer, err = src.AddPeer(addrs...); err != nil {
		t.Fatal(err)
	}
	return src, dst, peer
}

// TestRailsSplitWritesAndEachCompletesOnlyOnceLanded: two rails share a request's writes,
// and every write's local completion means its bytes are in the target's memory — the
// promise that lets the signal on rail 0 follow writes that went over rail 1. The target
// memory is checked at the moment each completion is read, before the target polls again.
func TestRailsSplitWritesAndEachCompletesOnlyOnceLanded(t *testing.T) {
	for _, provider := range []string{"tcp;ofi_rxm", "sockets"} {
		t.Run(provider, func(t *testing.T) {
			src, dst, peer := railPair(t, provider, 2, 2)
			const size, piece = 64 << 20, 8 << 20
			from, s := region(t, src, size, Source)
			to, d := region(t, dst, size, Target)
			if len(d.Keys) != 2 {
				t.Fatalf("region keys %v, want one per rail", d.Keys)
			}
			for i := range from {
				from[i] = byte(i*11 + i>>20)
			}
			l := &link{t: t, src: src, dst: dst}
			for off := uint64(0); off < size; off += piece {
				l.post(func() error { return src.Write(peer, s, off, piece, d.RemoteAddr(off), d.Keys, off/piece+1) })
			}
			checked := 0
			l.until("the writes' completions", func() bool {
				for ; checked < len(l.s); checked++ {
					off := (l.s[checked].ID - 1) * piece
					if !bytes.Equal(from[off:off+piece], to[off:off+piece]) {
						t.Fatalf("write %d completed at the source before its bytes were at the target", l.s[checked].ID)
					}
				}
				return checked == size/piece
			})
			sent := src.RailBytes()
			// Each write goes to the rail with fewer bytes in flight, which completions
			// reaped between posts change: split, not necessarily evenly.
			if sent[0]+sent[1] != size || sent[0] < size/4 || sent[1] < size/4 {
				t.Fatalf("rails carried %v bytes; want the %d bytes split over both", sent, size)
			}
			l.post(func() error { return src.WriteData(peer, 9, d.RemoteAddr(0), d.Keys, 1000) })
			l.until("the signal at the target", func() bool { return len(l.d) > 0 })
			if c := l.d[0]; !c.Remote || c.Data != 9 {
				t.Fatalf("target completion %+v, want remote data 9", c)
			}
		})
	}
}

// TestRailsMeetAPeerWithFewer: an endpoint of two rails writing to a peer of one uses
// the one rail they share.
func TestRailsMeetAPeerWithFewer(t *testing.T) {
	src, dst, peer := railPair(t, "tcp;ofi_rxm", 2, 1)
	from, s := region(t, src, 1<<20, Source)
	to, d := region(t, dst, 1<<20, Target)
	for i := range from {
		from[i] = byte(i * 3)
	}
	l := &link{t: t, src: src, dst: dst}
	for i := range uint64(4) {
		l.post(func() error { return src.Write(peer, s, i<<18, 1<<18, d.RemoteAddr(i<<18), d.Keys, i+1) })
	}
	l.until("the writes' completions", func() bool { return len(l.s) == 4 })
	l.post(func() error { return src.WriteData(peer, 1, d.RemoteAddr(0), d.Keys, 99) })
	l.until("the signal", func() bool { return len(l.d) > 0 })
	if !bytes.Equal(from, to) {
		t.Fatal("data missing after the signal")
	}
	if sent := src.RailBytes(); sent[1] != 0 {
		t.Fatalf("rail 1 carried %d bytes to a peer without it", sent[1])
	}
}

// TestRailsOpenTheNamedDomains: each rail opens the domain (NIC) named for it, in order,
// and a request's writes land over both; a domain the provider lacks is refused by name.
// On loopback tcp's domains are the host's interfaces (lo, and eth0 where there is one).
func TestRailsOpenTheNamedDomains(t *testing.T) {
	const provider = "tcp;ofi_rxm"
	domains, err := Domains(provider)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Contains(domains, "lo") {
		t.Fatalf("domains %v of %s lack the loopback interface", domains, provider)
	}
	named := []string{domains[len(domains)-1], domains[0]} // two NICs where the host has two
	t.Logf("domains %v; rails on %v", domains, named)
	open := func() (*Endpoint, error) { return OpenDomains(provider, named) }
	src, dst, peer := connect(t, open, open)
	if got := src.Domains(); !slices.Equal(got, named) {
		t.Fatalf("rails opened domains %v, want %v", got, named)
	}
	// Pieces as large as the split test's: with small ones every write can finish on the
	// rail whose connection came up first, before the other's does.
	const size, piece = 64 << 20, 8 << 20
	from, s := region(t, src, size, Source)
	to, d := region(t, dst, size, Target)
	for i := range from {
		from[i] = byte(i*7 + i>>16)
	}
	l := &link{t: t, src: src, dst: dst}
	l.writeAll(peer, s, d, size, piece)
	if !bytes.Equal(from, to) {
		t.Fatal("the target's memory differs from the source")
	}
	if sent := src.RailBytes(); sent[0] == 0 || sent[1] == 0 {
		t.Fatalf("rails carried %v bytes; want both used", sent)
	}

	if _, err := OpenDomains(provider, []string{"lo", "no-such-nic"}); err == nil || !strings.Contains(err.Error(), "no-such-nic") {
		t.Fatalf("a rail on a domain the provider lacks: %v", err)
	}
}

func TestRailsAreRefusedWhereThereAreNone(t *testing.T) {
	if _, err := OpenRails("shm", 2); err == nil || !strings.Contains(err.Error(), "no rails") {
		t.Fatalf("two shm rails: %v", err)
	}
	if _, err := OpenRails("tcp;ofi_rxm", MaxRails+1); err == nil {
		t.Fatal("opened more rails than MaxRails")
	}
}

func TestOpenRefusesAMissingProvider(t *testing.T) {
	if _, err := Open("efa"); err == nil {
		t.Fatal("opened efa on a machine without EFA devices; it must fail, not fall back")
	}
}

func TestWriteRefusesLocalBounds(t *testing.T) {
	src, dst, peer := pair(t, "tcp;ofi_rxm")
	_, s := region(t, src, 4096, Source)
	_, d := region(t, dst, 4096, Target)
	if err := src.Write(peer, s, 4000, 200, d.RemoteAddr(0), d.Keys, 1); err == nil {
		t.Fatal("wrote past the end of the source region")
	}
}

// TestWaitMovesDataAndWakes: on tcp;ofi_rxm the target's Wait sleeps in the kernel and
// still moves incoming data (incoming RMA raises no completion, so only the signal ends
// the wait), and Wake ends a Wait from another goroutine at once — on one rail, and on
// two, where rail 1's data moves in its own thread while the owner sleeps in rail 0's.
func TestWaitMovesDataAndWakes(t *testing.T) {
	for _, rails := range []int{1, 2} {
		t.Run(fmt.Sprintf("%d rails", rails), func(t *testing.T) { waitMovesDataAndWakes(t, rails) })
	}
}

func waitMovesDataAndWakes(t *testing.T, rails int) {
	src, dst, peer := railPair(t, "tcp;ofi_rxm", rails, rails)
	if !dst.Waitable() {
		t.Fatal("tcp;ofi_rxm endpoints should have a wait object")
	}
	const size = 16 << 20
	from, s := region(t, src, size, Source)
	to, d := region(t, dst, size, Target)
	for i := range from {
		from[i] = byte(i * 13)
	}
	signalled := make(chan struct{})
	go func() {
		defer close(signalled)
		buf := make([]Completion, 16)
		for {
			for _, c := range buf[:dst.Wait(buf, time.Second)] {
				if c.Remote {
					return
				}
			}
		}
	}()
	buf := make([]Completion, 16)
	done := 0 // writes completed, counted wherever their completions are read
	reap := func() {
		for _, c := range buf[:src.Poll(buf)] {
			if c.Err != nil {
				t.Fatal(c.Err)
			}
			if c.ID == 1 || c.ID == 2 {
				done++
			}
		}
	}
	post := func(op func() error) {
		for err := op(); err != nil; err = op() {
			if err != ErrAgain {
				t.Fatal(err)
			}
			reap()
		}
	}
	const piece = size / 2
	for i := range uint64(2) {
		post(func() error { return src.Write(peer, s, i*piece, piece, d.RemoteAddr(i*piece), d.Keys, i+1) })
	}
	for done < 2 {
		reap()
	}
	if sent := src.RailBytes(); sent[rails-1] == 0 {
		t.Fatalf("rail %d carried nothing: %v", rails-1, sent)
	}

	post(func() error { return src.WriteData(peer, 7, d.RemoteAddr(0), d.Keys, 2) })
	for {
		src.Poll(buf)
		select {
		case <-signalled:
			if !bytes.Equal(from, to) {
				t.Fatal("data missing after the signal")
			}
			woke := make(chan time.Duration)
			go func() {
				start := time.Now()
				dst.Wait(buf, 30*time.Second)
				woke <- time.Since(start)
			}()
			for {
				dst.Wake()
				select {
				case d := <-woke:
					if d > 10*time.Second {
						t.Fatalf("Wait returned after %v, not at the Wake", d)
					}
					return
				default:
				}
			}
		default:
		}
	}
}
