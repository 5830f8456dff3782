//go:build gpu

package cuda

import (
	"bytes"
	"encoding/hex"
	"encoding/json"
	"os"
	"os/exec"
	"strconv"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"
)

const passedSize = 64 << 20

type passedResult struct {
	PID            int    `json:"pid"`
	Verified       bool   `json:"verified"`
	BeyondRefused  string `json:"beyond_refused"`
	LegacyIPCError string `json:"legacy_ipc_error"`
	Err            string `json:"error,omitempty"`
}

// passedChild runs in PID and mount namespaces of its own, with its own /proc, as a
// container does: it maps the allocation passed as fd 3 and checks its bytes, asks for
// more than was passed, and tries the legacy IPC handle.
func passedChild() int {
	res := passedResult{PID: os.Getpid()}
	defer func() { _ = json.NewEncoder(os.Stdout).Encode(res) }()
	if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil {
		res.Err = "making mounts private: " + err.Error()
		return 0
	}
	if err := unix.Mount("proc", "/proc", "proc", 0, ""); err != nil {
		res.Err = "mounting /proc: " + err.Error()
		return 0
	}
	size, _ := strconv.ParseUint(os.Getenv("KVH_CUDA_SIZE"), 10, 64)
	sh, err := ImportFD(3)
	if err != nil {
		res.Err = err.Error()
		return 0
	}
	c, err := Open(sh.Ordinal)
	if err != nil {
		res.Err = err.Error()
		return 0
	}
	p, err := c.Map(sh, size, []int{sh.Ordinal})
	if err != nil {
		res.Err = err.Error()
		return 0
	}
	got := make([]byte, passedSize)
	if err := c.Download(got, p); err != nil {
		res.Err = err.Error()
		return 0
	}
	res.Verified = bytes.Equal(got, pattern(passedSize, 0x3c))
	_ = c.Unmap(p, size)
	if sh, err = ImportFD(3); err == nil {
		if p, err = c.Map(sh, size+sh.Granularity, []int{sh.Ordinal}); err == nil {
			_ = c.Unmap(p, size+sh.Granularity)
		} else {
			res.BeyondRefused = err.Error()
		}
	}
	raw, _ := hex.DecodeString(os.Getenv("KVH_CUDA_HANDLE"))
	var h IPCHandle
	copy(h[:], raw)
	if lp, err := c.Import(h); err != nil {
		res.LegacyIPCError = err.Error()
	} else {
		_ = c.Unimport(lp)
	}
	return 0
}

// TestAnAllocationPassedAsAFileMapsInAnotherPIDNamespace: GPU memory passed as a POSIX fd
// (what engines give the agent) maps in a process of another PID namespace, byte for byte,
// and no further than the allocation: so engines need not share the host's PID namespace.
// A legacy IPC handle is tried there too, and what the driver said is logged.
func TestAnAllocationPassedAsAFileMapsInAnotherPIDNamespace(t *testing.T) {
	g, err := Open(0)
	if err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	p, size, fd, err := g.AllocShareable(passedSize)
	if err != nil {
		t.Fatal(err)
	}
	defer g.Unmap(p, size)
	if err := g.Upload(p, pattern(passedSize, 0x3c)); err != nil {
		t.Fatal(err)
	}
	legacy, err := g.Alloc(1 << 21)
	if err != nil {
		t.Fatal(err)
	}
	defer g.Free(legacy)
	h, err := g.Export(legacy)
	if err != nil {
		t.Fatal(err)
	}
	f := os.NewFile(uintptr(fd), "cuda-allocation")
	defer f.Close()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), "KVH_CUDA_CHILD=passed", "KVH_CUDA_SIZE="+strconv.FormatUint(size, 10), "KVH_CUDA_HANDLE="+hex.EncodeToString(h[:]))
	cmd.ExtraFiles = []*os.File{f}
	cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWPID | syscall.CLONE_NEWNS}
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("child in new PID and mount namespaces (needs CAP_SYS_ADMIN): %v\n%s", err, out)
	}
	var res passedResult
	if err := json.Unmarshal(out, &res); err != nil {
		t.Fatalf("child said %q: %v", out, err)
	}
	switch {
	case res.Err != "":
		t.Fatal("child: " + res.Err)
	case res.PID != 1:
		t.Fatalf("the child is pid %d: not in a PID namespace of its own", res.PID)
	case !res.Verified:
		t.Fatal("the bytes read through the passed allocation differ from the source")
	case res.BeyondRefused == "":
		t.Fatal("mapping a granule more than the passed allocation was accepted")
	}
	t.Logf("passed allocation of %d bytes mapped and read in a child of its own PID namespace; beyond it: %s; legacy IPC handle there: %q",
		size, res.BeyondRefused, res.LegacyIPCError)
}
