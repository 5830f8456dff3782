package agent_test

import (
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/kvhandoff/kvhandoff/test/agentproc"
	agentv1 "github.com/kvhandoff/kvhandoff/transferagent/api/v1"
	"github.com/kvhandoff/kvhandoff/transferagent/client"
)

// openFDs counts the open files of process pid.
func openFDs(t *testing.T, pid int) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/" + strconv.Itoa(pid) + "/fd")
	if err != nil {
		t.Fatal(err)
	}
	return len(ents)
}

// A packet of no bytes that carries an fd hands the agent that fd all the same: the agent
// closes it. Before, it returned without, and 50 such packets left 50 fds (and the
// memory behind them) open in the agent after their sender had gone.
func TestEmptyPacketsWithFDsLeakNothing(t *testing.T) {
	a := startAgent(t, "node", t.TempDir())
	fd, mem, err := client.NewMemory("passed", 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(mem)
	defer unix.Close(fd)
	before := openFDs(t, a.Pid())
	const packets = 50
	for range packets {
		sendEmpty(t, agentv1.MemorySocket(a.Socket), fd)
	}
	until(t, "the passed fds are closed", func() bool { return openFDs(t, a.Pid()) <= before+2 })
}

// A memfd with pages never allocated is refused when passed: mapping it would charge the
// engine's memory to the agent (measured before: 1 GiB of holes, agent RssShmem +1 GiB).
func TestASparseMemfdIsRefused(t *testing.T) {
	a := startAgent(t, "node", t.TempDir())
	e := bareEngine(t, a, "sparse", agentv1.Role_ROLE_DECODE)
	fd, err := unix.MemfdCreate("sparse", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	if err := unix.Ftruncate(fd, 1<<30); err != nil {
		t.Fatal(err)
	}
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, unix.F_SEAL_SHRINK|unix.F_SEAL_GROW); err != nil {
		t.Fatal(err)
	}
	_, err = client.PassMemory(agentv1.MemorySocket(a.Socket), e.Session, fd)
	if err == nil || !strings.Contains(err.Error(), "fallocate") {
		t.Errorf("a sparse memfd: %v, want a refusal saying to allocate its pages", err)
	}
}

// sendEmpty sends one packet of no bytes carrying fd to the SOCK_SEQPACKET socket at path
// and waits for the agent to end the connection. Go's own sendmsg adds a byte to such a
// packet, so it is built by hand.
func sendEmpty(t *testing.T, path string, fd int) {
	t.Helper()
	s, err := unix.Socket(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(s)
	if err := unix.Connect(s, &unix.SockaddrUnix{Name: path}); err != nil {
		t.Fatal(err)
	}
	oob := unix.UnixRights(fd)
	var msg unix.Msghdr
	msg.Control = &oob[0]
	msg.SetControllen(len(oob))
	if _, _, errno := unix.Syscall(unix.SYS_SENDMSG, uintptr(s), uintptr(unsafe.Pointer(&msg)), 0); errno != 0 {
		t.Fatal(errno)
	}
	buf := make([]byte, 64)
	for {
		if n, err := unix.Read(s, buf); n <= 0 || err != nil {
			return
		}
	}
}

// The agent refuses a socket folder that anyone but itself could write to: whoever can
// replace agent.sock there intercepts every engine of the node (measured before: a root
// engine beside a writable folder replaced it).
func TestTheAgentRefusesASocketFolderItDoesNotOwnAlone(t *testing.T) {
	token := filepath.Join(t.TempDir(), "token")
	if err := os.WriteFile(token, []byte(agentproc.Token), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		name   string
		prep   func(dir string) error
		saying string
	}{
		{"writable by others", func(dir string) error { return os.Chmod(dir, 0o777) }, "writable by its group or others"},
		{"owned by another user", func(dir string) error { return os.Chown(dir, 1000, 1000) }, "belongs to uid 1000"},
	} {
		dir := filepath.Join(t.TempDir(), "sockets")
		if err := os.Mkdir(dir, 0o750); err != nil {
			t.Fatal(err)
		}
		if err := c.prep(dir); err != nil {
			t.Fatal(err)
		}
		out, err := exec.Command(agentBin, "--provider", provider(), "--socket", filepath.Join(dir, "agent.sock"),
			"--peer-listen", "127.0.0.1:0", "--http", "127.0.0.1:0", "--peer-token-file", token).CombinedOutput()
		if err == nil || !strings.Contains(string(out), c.saying) {
			t.Errorf("%s: the agent ran (%v) or did not say why:\n%s", c.name, err, out)
		}
	}
}
