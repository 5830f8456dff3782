package peercred

import (
	"net"
	"path/filepath"
	"strings"
	"testing"
)

// The pod UID is found as both kubelet cgroup drivers write it, in cgroup v1 and v2
// files, and in paths relative to the reader's cgroup namespace; nothing else is taken
// for one.
func TestPodOfCgroup(t *testing.T) {
	const uid = "0f3a7c52-9b1e-4d6a-8c2f-5e4b3a291d70"
	for name, c := range map[string]struct{ cgroup, want string }{
		"v2 systemd":                           {"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod0f3a7c52_9b1e_4d6a_8c2f_5e4b3a291d70.slice/cri-containerd-ab12.scope\n", uid},
		"v2 guaranteed":                        {"0::/kubepods.slice/kubepods-pod0f3a7c52_9b1e_4d6a_8c2f_5e4b3a291d70.slice/cri-containerd-ab12.scope\n", uid},
		"v2 cgroupfs":                          {"0::/kubepods/besteffort/pod0f3a7c52-9b1e-4d6a-8c2f-5e4b3a291d70/ab12\n", uid},
		"v2 relative to the agent's namespace": {"0::/../../kubepods-besteffort-pod0f3a7c52_9b1e_4d6a_8c2f_5e4b3a291d70.slice/cri-containerd-ab12.scope\n", uid},
		"v1":                                   {"12:memory:/kubepods/burstable/pod0f3a7c52-9b1e-4d6a-8c2f-5e4b3a291d70/ab12\n11:cpu,cpuacct:/kubepods/burstable/pod0f3a7c52-9b1e-4d6a-8c2f-5e4b3a291d70/ab12\n", uid},
		"host process":                         {"0::/user.slice/user-0.slice/session-4.scope\n", ""},
		"a unit merely named pod…":             {"0::/system.slice/podman-0f3a7c52-9b1e-4d6a-8c2f-5e4b3a291d70.scope\n", ""},
		"a pod UID inside a longer name":       {"0::/system.slice/xpod0f3a7c52-9b1e-4d6a-8c2f-5e4b3a291d70x.slice\n", ""},
		"a folder ending in pod<uid>":          {"0::/system.slice/xpod0f3a7c52-9b1e-4d6a-8c2f-5e4b3a291d70/a\n", ""},
		"empty":                                {"", ""},
	} {
		if got := PodOfCgroup(c.cgroup); got != c.want {
			t.Errorf("%s: pod %q, want %q", name, got, c.want)
		}
	}
}

// An owner's connections beyond its share are refused, and the refusal is reported (gRPC
// only logs a failed handshake); a closed connection gives its slot back. Over a real
// Unix socket, whose peer credentials are this process's.
func TestConnectionsBeyondAnOwnersShareAreRefusedAndReported(t *testing.T) {
	ln, err := net.Listen("unix", filepath.Join(t.TempDir(), "s"))
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	var refused []string
	creds := Credentials{Conns: NewSlots(1), Refused: func(code string, err error) { refused = append(refused, code+": "+err.Error()) }}
	handshake := func() (net.Conn, error) {
		c, err := net.Dial("unix", ln.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		s, err := ln.Accept()
		if err != nil {
			t.Fatal(err)
		}
		conn, _, err := creds.ServerHandshake(s)
		if err != nil {
			s.Close()
		}
		return conn, err
	}
	first, err := handshake()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := handshake(); err == nil || len(refused) != 1 || !strings.HasPrefix(refused[0], "ResourceExhausted: ") ||
		!strings.Contains(refused[0], "already holds 1 connections") {
		t.Fatalf("a second connection of the owner: %v, reported %q", err, refused)
	}
	first.Close()
	if c, err := handshake(); err != nil {
		t.Fatalf("after the first closed: %v", err)
	} else {
		c.Close()
	}
}
