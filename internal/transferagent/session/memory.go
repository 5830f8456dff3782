package session

import (
	"fmt"
	"os"
	"sync"
	"syscall"

	"golang.org/x/sys/unix"
)

// mapping is an engine's host memory as the agent maps it: a shared mapping of a memfd
// the engine passed, so the agent registers memory it does not own, without a copy.
type mapping struct {
	file       fileID
	off, size  uint64
	whole, mem []byte // whole is the page-aligned mapping; mem the region inside it
}

type fileID struct{ dev, ino uint64 }

func (m *mapping) unmap() {
	if m.whole != nil {
		_ = syscall.Munmap(m.whole)
		m.whole, m.mem = nil, nil
	}
}

// CheckSealed accepts only a memfd sealed against shrinking whose every page exists.
//
// The seal is what keeps the mapping whole: a shrunk file faults every access past its
// new end, and the provider's copies into decode memory run in this process (measured:
// on tcp;ofi_rxm a truncated decode file killed the agent with SIGBUS). Seals can only be
// added, never removed, so once checked the file can never shrink.
//
// Pages must exist because whoever faults a page of shared memory in is charged for it:
// mapping a sparse memfd (measured: 1 GiB of holes) would charge the engine's memory to
// the agent's cgroup, and one engine could have the agent killed for every engine of the
// node. The engine allocates its pages (fallocate, or writing them) before passing them.
func CheckSealed(fd int) (fileID, int64, error) {
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return fileID{}, 0, err
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG {
		return fileID{}, 0, fmt.Errorf("not a regular file: pass a memfd")
	}
	seals, err := unix.FcntlInt(uintptr(fd), unix.F_GET_SEALS, 0)
	if err != nil {
		return fileID{}, 0, fmt.Errorf("not a memfd (%v): pass one created with MFD_ALLOW_SEALING and sealed with F_SEAL_SHRINK", err)
	}
	if seals&unix.F_SEAL_SHRINK == 0 {
		return fileID{}, 0, fmt.Errorf("the memfd is not sealed against shrinking: add F_SEAL_SHRINK before passing it")
	}
	if st.Blocks*512 < st.Size {
		return fileID{}, 0, fmt.Errorf("the memfd has %d of its %d bytes allocated: allocate every page (fallocate) before passing it; "+
			"the agent does not fault in an engine's memory", st.Blocks*512, st.Size)
	}
	return fileID{dev: uint64(st.Dev), ino: st.Ino}, st.Size, nil
}

// allocated reports whether every page of a memfd still exists. The seals that keep the
// file from shrinking still let its engine punch holes in it (FALLOC_FL_PUNCH_HOLE), and
// the agent's next access would fault those pages back in, charged to the agent
// (measured: RssShmem 0 → 128 MB), which is what CheckSealed refuses at the start.
func allocated(f *os.File) (missing int64, err error) {
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return 0, err
	}
	return max(st.Size-st.Blocks*512, 0), nil
}

// mapFD maps size bytes at off of a sealed memfd. It checks the seal itself (the memory
// socket did too), so it is safe on its own.
func mapFD(f *os.File, off, size uint64) (*mapping, error) {
	id, fsize, err := CheckSealed(int(f.Fd()))
	if err != nil {
		return nil, fmt.Errorf("memory_handle: %w", err)
	}
	if size == 0 || off+size < off || off+size > uint64(fsize) {
		return nil, fmt.Errorf("size: %d bytes at offset %d do not fit the %d-byte memfd", size, off, fsize)
	}
	page := uint64(os.Getpagesize())
	start := off &^ (page - 1)
	// Page tables populated at registration, once, so that transfers never stop to fault
	// pages into this mapping; the pages themselves exist already (checkSealed).
	whole, err := syscall.Mmap(int(f.Fd()), int64(start), int(off+size-start), syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_SHARED|syscall.MAP_POPULATE)
	if err != nil {
		return nil, fmt.Errorf("mapping the memfd: %w", err)
	}
	return &mapping{file: id, off: off, size: size, whole: whole, mem: whole[off-start : off-start+size]}, nil
}

// memoryIndex records every registered range of every file, agent-wide: a region that
// overlaps another (of this engine or any other) is refused, so no engine can make the
// agent write into memory that another registration names.
type memoryIndex struct {
	mu    sync.Mutex
	files map[fileID][]claimed
}

type claimed struct {
	s         *Session
	region    uint32
	off, size uint64
}

// claim records s's region m, refusing a duplicate region id or an overlap.
func (idx *memoryIndex) claim(s *Session, region uint32, m *mapping) error {
	idx.mu.Lock()
	defer idx.mu.Unlock()
	for _, list := range idx.files {
		for _, c := range list {
			if c.s == s && c.region == region {
				return fmt.Errorf("region_id: %d is already registered by this engine", region)
			}
		}
	}
	for _, c := range idx.files[m.file] {
		if m.off < c.off+c.size && c.off < m.off+m.size {
			return fmt.Errorf("offset: bytes %d..%d overlap region %d of engine %s (bytes %d..%d of the same file)",
				m.off, m.off+m.size, c.region, c.s.key, c.off, c.off+c.size)
		}
	}
	idx.files[m.file] = append(idx.files[m.file], claimed{s: s, region: region, off: m.off, size: m.size})
	return nil
}

// release drops s's claim of region; remove drops every claim of s.
func (idx *memoryIndex) release(s *Session, region uint32) {
	idx.drop(func(c claimed) bool { return c.s == s && c.region == region })
}

func (idx *memoryIndex) remove(s *Session) { idx.drop(func(c claimed) bool { return c.s == s }) }

func (idx *memoryIndex) drop(match func(claimed) bool) {
	idx.mu.Lock()
	defer idx.mu.Unlock()
	for f, list := range idx.files {
		keep := list[:0]
		for _, c := range list {
			if !match(c) {
				keep = append(keep, c)
			}
		}
		if len(keep) == 0 {
			delete(idx.files, f)
		} else {
			idx.files[f] = keep
		}
	}
}
