// Package loopback gives tests and benchmarks addresses of their own on the loopback
// network, so that no port is ever found free, released, and handed to a process that
// another process may have taken meanwhile.
//
// A Host is an address in 127.128.0.0/9 claimed for as long as it is held: the claim is a
// UDP socket bound to ClaimPort on it, which no other claimant (Go or the Python harness
// in vllm-connector/tests/stack.py, which claims the same way) can bind while it is open.
// Every TCP port of a held host is its holder's to give to the processes it starts, as a
// pod's ports are its own: fixed ports below the kernel's ephemeral range
// (net.ipv4.ip_local_port_range, 32768 and up here) are never taken by another process's
// bind to port 0 or by an outgoing connection's local port.
package loopback

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"net/netip"
	"syscall"
)

// ClaimPort is the UDP port whose bind claims a host. UDP, so that every TCP port of the
// host stays free for its holder.
const ClaimPort = 1999

// first and size span the claimable hosts: 127.128.0.0/9.
const (
	first = 127<<24 | 128<<16
	size  = 1 << 23
)

// Host is a loopback address claimed until Release.
type Host struct {
	// IP is the host's address, e.g. 127.163.4.17.
	IP    string
	claim *net.UDPConn
}

// Claim claims a loopback host no one else holds.
func Claim() (*Host, error) {
	start := rand.Uint32N(size)
	for i := range uint32(4096) {
		n := first + (start+i)%size
		ip := netip.AddrFrom4([4]byte{byte(n >> 24), byte(n >> 16), byte(n >> 8), byte(n)})
		c, err := net.ListenUDP("udp4", net.UDPAddrFromAddrPort(netip.AddrPortFrom(ip, ClaimPort)))
		if errors.Is(err, syscall.EADDRINUSE) {
			continue // someone else's
		}
		if err != nil {
			return nil, fmt.Errorf("claiming loopback host %s: %w", ip, err)
		}
		return &Host{IP: ip.String(), claim: c}, nil
	}
	return nil, errors.New("no free loopback host in 4096 tries of 127.128.0.0/9")
}

// Addr is host:port on h.
func (h *Host) Addr(port int) string { return net.JoinHostPort(h.IP, fmt.Sprint(port)) }

// Release gives h up; its processes must have stopped.
func (h *Host) Release() error { return h.claim.Close() }

// T is what New and Refusing need of a test: testing.TB's, and Ginkgo's GinkgoT().
type T interface {
	Helper()
	Fatal(args ...any)
	Cleanup(func())
}

// New claims a host for the rest of the test and returns its IP.
func New(t T) string {
	t.Helper()
	h, err := Claim()
	if err != nil {
		t.Fatal(err)
	}
	// Cleanups run last-in first-out: the processes the test started on the host, whose
	// cleanups were registered after this one, have stopped when it is released.
	t.Cleanup(func() { _ = h.Release() })
	return h.IP
}

// Refusing returns an address whose connections are refused for the rest of the test: a
// TCP socket bound there and never listening, so no other process can start listening on
// it meanwhile.
func Refusing(t T) string {
	t.Helper()
	fd, err := syscall.Socket(syscall.AF_INET, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = syscall.Close(fd) })
	if err := syscall.Bind(fd, &syscall.SockaddrInet4{Addr: [4]byte{127, 0, 0, 1}}); err != nil {
		t.Fatal(err)
	}
	sa, err := syscall.Getsockname(fd)
	if err != nil {
		t.Fatal(err)
	}
	return fmt.Sprintf("127.0.0.1:%d", sa.(*syscall.SockaddrInet4).Port)
}
