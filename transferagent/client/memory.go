package client

import (
	"fmt"
	"net"
	"syscall"

	"golang.org/x/sys/unix"

	agentv1 "github.com/kvhandoff/kvhandoff/transferagent/api/v1"
)

// NewMemory creates size bytes of host memory to hold an engine's KV cache: a memfd
// sealed so it can never shrink or grow, mapped shared. The agent maps the same memfd
// (RegisterRegion passes it), so the KV is never copied; the seal keeps the agent's
// mapping whole whatever the engine does with its own fd. The caller closes fd once its
// regions are registered and unmaps mem when done.
func NewMemory(name string, size int) (fd int, mem []byte, err error) {
	fd, err = unix.MemfdCreate(name, unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		return -1, nil, fmt.Errorf("memfd_create: %w", err)
	}
	fail := func(what string, err error) (int, []byte, error) {
		unix.Close(fd)
		return -1, nil, fmt.Errorf("%s: %w", what, err)
	}
	if err := unix.Ftruncate(fd, int64(size)); err != nil {
		return fail("sizing the memfd", err)
	}
	// Every page allocated by the engine, which the agent requires: it maps only memory
	// that exists, so that the engine's memory is charged to the engine.
	if err := unix.Fallocate(fd, 0, 0, int64(size)); err != nil {
		return fail("allocating the memfd", err)
	}
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, unix.F_SEAL_SHRINK|unix.F_SEAL_GROW|unix.F_SEAL_SEAL); err != nil {
		return fail("sealing the memfd", err)
	}
	// Populated at once, as vLLM's KV cache is (torch allocates and zeroes it at start):
	// otherwise the first transfers into it pay for faulting in every page.
	if mem, err = syscall.Mmap(fd, 0, size, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_SHARED|syscall.MAP_POPULATE); err != nil {
		return fail("mapping the memfd", err)
	}
	return fd, mem, nil
}

// PassMemory hands fd to the agent for session over its memory socket and returns the
// handle a RegisterRegion names (the protocol is in agentv1.MemorySocketName's comment).
func PassMemory(socket, session string, fd int) (uint64, error) {
	return pass(socket, session, fd)
}

// PassCUDA hands the agent, for session, the POSIX fd of a GPU allocation of size bytes
// (cuMemExportToShareableHandle) and returns the handle its RegisterRegions name.
func PassCUDA(socket, session string, fd int, size uint64) (uint64, error) {
	return pass(socket, fmt.Sprintf("%s%s %d", agentv1.CUDAPrefix, session, size), fd)
}

func pass(socket, packet string, fd int) (uint64, error) {
	c, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: socket, Net: "unixpacket"})
	if err != nil {
		return 0, fmt.Errorf("memory socket: %w", err)
	}
	defer c.Close()
	if _, _, err := c.WriteMsgUnix([]byte(packet), unix.UnixRights(fd), nil); err != nil {
		return 0, fmt.Errorf("memory socket: %w", err)
	}
	buf := make([]byte, 512)
	n, err := c.Read(buf)
	if err != nil {
		return 0, fmt.Errorf("memory socket: %w", err)
	}
	return agentv1.ParseMemoryAnswer(buf[:n])
}
