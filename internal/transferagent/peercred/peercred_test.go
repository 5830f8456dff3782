package peercred

import "testing"

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
