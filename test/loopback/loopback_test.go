package loopback

import (
	"errors"
	"net"
	"net/netip"
	"syscall"
	"testing"
)

// A held host is no one else's: a second claim of it fails while the first is held, and
// succeeds once it is released; its TCP ports are free to its holder.
func TestAHostIsHeldUntilReleased(t *testing.T) {
	h, err := Claim()
	if err != nil {
		t.Fatal(err)
	}
	ip := netip.MustParseAddr(h.IP)
	if !netip.MustParsePrefix("127.128.0.0/9").Contains(ip) {
		t.Fatalf("claimed %s, outside 127.128.0.0/9", ip)
	}
	again := net.UDPAddrFromAddrPort(netip.AddrPortFrom(ip, ClaimPort))
	if c, err := net.ListenUDP("udp4", again); !errors.Is(err, syscall.EADDRINUSE) {
		if c != nil {
			c.Close()
		}
		t.Fatalf("claiming a held host again: %v, want EADDRINUSE", err)
	}
	l, err := net.Listen("tcp", h.Addr(ClaimPort))
	if err != nil {
		t.Fatalf("the holder's TCP port %d: %v", ClaimPort, err)
	}
	l.Close()
	if err := h.Release(); err != nil {
		t.Fatal(err)
	}
	c, err := net.ListenUDP("udp4", again)
	if err != nil {
		t.Fatalf("claiming a released host: %v", err)
	}
	c.Close()
}

// Hosts claimed one after another are distinct.
func TestClaimsAreDistinct(t *testing.T) {
	seen := map[string]bool{}
	for range 64 {
		ip := New(t)
		if seen[ip] {
			t.Fatalf("%s claimed twice", ip)
		}
		seen[ip] = true
	}
}

// A refusing address refuses, and no one can listen there while the test holds it.
func TestARefusingAddressRefusesAndCannotBeTaken(t *testing.T) {
	addr := Refusing(t)
	if c, err := net.Dial("tcp", addr); !errors.Is(err, syscall.ECONNREFUSED) {
		if c != nil {
			c.Close()
		}
		t.Fatalf("dialling %s: %v, want ECONNREFUSED", addr, err)
	}
	if l, err := net.Listen("tcp", addr); err == nil {
		l.Close()
		t.Fatalf("listened on %s while it was held", addr)
	}
}
