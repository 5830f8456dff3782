// Package peercred says who is at the other end of one of the agent's Unix sockets: the
// process, user and group the kernel recorded when it connected (SO_PEERCRED), and the
// Kubernetes pod that process runs in, read from its cgroup. The agent binds engine
// sessions to that caller, and caps what each caller may hold open, so that one engine
// can neither act for another nor crowd it out.
package peercred

import (
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"strings"

	"golang.org/x/sys/unix"
)

// Caller is the process at the other end of a Unix socket, as the kernel saw it connect.
type Caller struct {
	// PID is in the agent's PID namespace: 0 when the caller's process is not visible
	// there (an agent without hostPID sees no engine's).
	PID int32
	UID uint32
	GID uint32
	// Pod is the UID of the pod the process runs in, "" for a process outside pods.
	Pod string
}

// Owner names what the caller's sessions and slots belong to: its pod, which every
// container and process of one engine shares; outside pods, its user.
func (c Caller) Owner() string {
	if c.Pod != "" {
		return "pod " + c.Pod
	}
	return fmt.Sprintf("uid %d", c.UID)
}

func (c Caller) String() string {
	return fmt.Sprintf("pid %d uid %d (%s)", c.PID, c.UID, c.Owner())
}

// Reader reads callers; ProcRoot is where their /proc entries are ("" for /proc; tests
// point it at a folder of their own to place a process in a pod).
type Reader struct {
	ProcRoot string
}

// Of reads the caller of a connected Unix socket.
func (r Reader) Of(c *net.UnixConn) (Caller, error) {
	raw, err := c.SyscallConn()
	if err != nil {
		return Caller{}, err
	}
	var cred *unix.Ucred
	var serr error
	if err := raw.Control(func(fd uintptr) {
		cred, serr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil {
		return Caller{}, err
	}
	if serr != nil {
		return Caller{}, fmt.Errorf("SO_PEERCRED: %w", serr)
	}
	caller := Caller{PID: cred.Pid, UID: cred.Uid, GID: cred.Gid}
	if cred.Pid > 0 {
		if caller.Pod, err = r.pod(cred.Pid); err != nil {
			return Caller{}, err
		}
	}
	return caller, nil
}

// podInCgroup finds a pod UID in a cgroup path, as both kubelet cgroup drivers write it:
// systemd ".../kubepods-burstable-pod<uid with _>.slice/..." and cgroupfs
// ".../kubepods/burstable/pod<uid>/...". A path relative to the reader's own cgroup
// namespace ("/../../kubepods-...") holds it the same way.
var podInCgroup = regexp.MustCompile(`(?:^|[/-])pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})(\.slice)?(/|$)`)

// pod reads which pod process pid runs in from its cgroup ("" if none). A process that
// exited since it connected is an error: nothing can be said of it.
func (r Reader) pod(pid int32) (string, error) {
	root := r.ProcRoot
	if root == "" {
		root = "/proc"
	}
	b, err := os.ReadFile(filepath.Join(root, fmt.Sprint(pid), "cgroup"))
	if errors.Is(err, os.ErrNotExist) {
		return "", fmt.Errorf("caller pid %d has exited", pid)
	}
	if err != nil {
		return "", err
	}
	return PodOfCgroup(string(b)), nil
}

// PodOfCgroup returns the pod UID in the contents of a /proc/<pid>/cgroup file, or "".
func PodOfCgroup(cgroup string) string {
	for _, line := range strings.Split(cgroup, "\n") {
		// hierarchy-ID:controllers:path; the path may itself hold colons.
		parts := strings.SplitN(line, ":", 3)
		if len(parts) != 3 {
			continue
		}
		if m := podInCgroup.FindStringSubmatch(parts[2]); m != nil {
			return strings.ReplaceAll(m[1], "_", "-")
		}
	}
	return ""
}
