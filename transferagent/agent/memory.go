package agent

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"
)

// mapping is an engine's host memory as the agent maps it: a shared mapping of a file
// in the memory directory, so the agent registers memory it does not own.
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

// mapFile maps size bytes at off of path, a regular file beneath the memory folder dir
// (opened once as dirFD): an engine may hand the agent its KV memory, never any other file
// on the node. The file is opened with openat2 resolving beneath the folder and through
// no symlink at all, in one step: nothing can be swapped between a check and the open.
func mapFile(dirFD int, dir, path string, off, size uint64) (*mapping, error) {
	if path == "" {
		return nil, fmt.Errorf("path: must name a file in the memory directory %s", dir)
	}
	rel := path
	if filepath.IsAbs(path) {
		var err error
		if rel, err = filepath.Rel(dir, path); err != nil {
			return nil, fmt.Errorf("path: %s is outside the memory directory %s", path, dir)
		}
	}
	if rel == "." || rel == ".." || strings.HasPrefix(rel, "../") {
		return nil, fmt.Errorf("path: %s is outside the memory directory %s", path, dir)
	}
	fd, err := unix.Openat2(dirFD, rel, &unix.OpenHow{
		Flags:   unix.O_RDWR | unix.O_CLOEXEC | unix.O_NOFOLLOW,
		Resolve: unix.RESOLVE_BENEATH | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS,
	})
	switch {
	case errors.Is(err, unix.ELOOP) || errors.Is(err, unix.EXDEV):
		return nil, fmt.Errorf("path: %s is outside the memory directory %s or reached through a symlink", path, dir)
	case err != nil:
		return nil, fmt.Errorf("path: %s: %w", path, err)
	}
	f := os.NewFile(uintptr(fd), path)
	defer f.Close()
	var st syscall.Stat_t
	if err := syscall.Fstat(int(f.Fd()), &st); err != nil {
		return nil, fmt.Errorf("path: %w", err)
	}
	if st.Mode&syscall.S_IFMT != syscall.S_IFREG {
		return nil, fmt.Errorf("path: %s is not a regular file", path)
	}
	if size == 0 || off+size < off || off+size > uint64(st.Size) {
		return nil, fmt.Errorf("size: %d bytes at offset %d do not fit the %d-byte file %s", size, off, st.Size, path)
	}
	page := uint64(os.Getpagesize())
	start := off &^ (page - 1)
	whole, err := syscall.Mmap(int(f.Fd()), int64(start), int(off+size-start), syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("mapping %s: %w", path, err)
	}
	return &mapping{
		file: fileID{dev: uint64(st.Dev), ino: st.Ino}, off: off, size: size,
		whole: whole, mem: whole[off-start : off-start+size],
	}, nil
}

// memoryIndex records every registered range of every file, agent-wide: a region that
// overlaps another (of this engine or any other) is refused, so no engine can make the
// agent write into memory that another registration names.
type memoryIndex map[fileID][]claimed

type claimed struct {
	s         *session
	region    uint32
	off, size uint64
}

// claim records s's region m, refusing a duplicate region id or an overlap.
func (a *Agent) claim(s *session, region uint32, m *mapping) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	for _, list := range a.memory {
		for _, c := range list {
			if c.s == s && c.region == region {
				return fmt.Errorf("region_id: %d is already registered by this engine", region)
			}
		}
	}
	for _, c := range a.memory[m.file] {
		if m.off < c.off+c.size && c.off < m.off+m.size {
			return fmt.Errorf("offset: bytes %d..%d overlap region %d of engine %s (bytes %d..%d of the same file)",
				m.off, m.off+m.size, c.region, c.s.key, c.off, c.off+c.size)
		}
	}
	a.memory[m.file] = append(a.memory[m.file], claimed{s: s, region: region, off: m.off, size: m.size})
	return nil
}

func (a *Agent) release(s *session, region uint32) {
	a.mu.Lock()
	defer a.mu.Unlock()
	for f, list := range a.memory {
		keep := list[:0]
		for _, c := range list {
			if c.s != s || c.region != region {
				keep = append(keep, c)
			}
		}
		a.memory[f] = keep
	}
}

// remove drops every claim of s (a.mu held).
func (idx memoryIndex) remove(s *session) {
	for f, list := range idx {
		keep := list[:0]
		for _, c := range list {
			if c.s != s {
				keep = append(keep, c)
			}
		}
		if len(keep) == 0 {
			delete(idx, f)
		} else {
			idx[f] = keep
		}
	}
}
