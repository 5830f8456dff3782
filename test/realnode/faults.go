package realnode

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"
)

// KillContainer SIGKILLs every process of a pod's container, as a crash or the kernel's
// OOM killer ends it: no SIGTERM, no preStop hook, no drain. The kubelet sees it exit
// and restarts it in the same pod. It returns how many processes it killed. Only on
// this machine's node: the container's processes are found in the kubelet's cgroups.
func (n *Node) KillContainer(ctx context.Context, namespace, pod, container string) (int, error) {
	pids, err := n.containerPIDs(ctx, namespace, pod, container)
	if err != nil {
		return 0, fmt.Errorf("killing %s/%s's %s: %w", namespace, pod, container, err)
	}
	for _, pid := range pids {
		if err := syscall.Kill(pid, syscall.SIGKILL); err != nil && err != syscall.ESRCH {
			return 0, fmt.Errorf("killing process %d of %s/%s: %w", pid, namespace, pod, err)
		}
	}
	return len(pids), nil
}

// containerPIDs are the processes of a pod's running container, found in the kubelet's
// cgroups on this machine.
func (n *Node) containerPIDs(ctx context.Context, namespace, pod, container string) ([]int, error) {
	if n.external {
		return nil, errors.New("the cluster is not on this machine")
	}
	p := &corev1.Pod{}
	if err := n.Client.Get(ctx, client.ObjectKey{Namespace: namespace, Name: pod}, p); err != nil {
		return nil, err
	}
	var id string
	for _, s := range p.Status.ContainerStatuses {
		if s.Name == container && s.State.Running != nil {
			_, id, _ = strings.Cut(s.ContainerID, "://")
		}
	}
	if id == "" {
		return nil, fmt.Errorf("%s/%s has no running container %s", namespace, pod, container)
	}
	// The kubelet's cgroupfs driver puts a container in <root>/kubepods/<qos>/pod<uid>/<id>.
	var pids []int
	for _, h := range hierarchies() {
		_ = filepath.WalkDir(filepath.Join(h, n.cgroupRoot), func(path string, d os.DirEntry, err error) error {
			if err != nil || !d.IsDir() || d.Name() != id {
				return nil
			}
			b, _ := os.ReadFile(filepath.Join(path, "cgroup.procs"))
			for _, f := range strings.Fields(string(b)) {
				if pid, err := strconv.Atoi(f); err == nil {
					pids = append(pids, pid)
				}
			}
			return filepath.SkipDir
		})
		if len(pids) > 0 {
			return pids, nil // every hierarchy holds the same processes
		}
	}
	return nil, fmt.Errorf("no process of %s/%s's container %s (%s) under the kubelet's cgroups", namespace, pod, container, id)
}

// CutNetwork cuts a host-network pod's container off the network for down, both ways,
// as a partition, a flapping NIC or a switch reboot does, then restores it; it returns
// how many TCP ports it cut. Every packet to a port the container's sockets hold at the
// cut is dropped on its way in (this namespace delivers every packet the container sends
// or receives locally, the loopback included), so established connections stall and
// retransmit rather than reset, and new connections to its listeners go unanswered.
// Sockets the container opens during the cut are not cut.
func (n *Node) CutNetwork(ctx context.Context, namespace, pod, container string, down time.Duration) (int, error) {
	pids, err := n.containerPIDs(ctx, namespace, pod, container)
	if err != nil {
		return 0, fmt.Errorf("cutting %s/%s's %s off: %w", namespace, pod, container, err)
	}
	ports, err := tcpPorts(pids)
	if err != nil {
		return 0, err
	}
	if len(ports) == 0 {
		return 0, fmt.Errorf("cutting %s/%s's %s off: it holds no TCP socket", namespace, pod, container)
	}
	const chain = "KVHANDOFF-CUT"
	cut := len(ports)
	cmds := [][]string{{"-N", chain}}
	for len(ports) > 0 { // multiport takes 15 ports a rule
		k := min(len(ports), 15)
		cmds = append(cmds, []string{"-A", chain, "-p", "tcp", "-m", "multiport", "--dports", strings.Join(ports[:k], ","), "-j", "DROP"})
		ports = ports[k:]
	}
	cmds = append(cmds, []string{"-I", "INPUT", "1", "-j", chain})
	restore := [][]string{{"-D", "INPUT", "-j", chain}, {"-F", chain}, {"-X", chain}}
	defer func() {
		for _, c := range restore {
			_ = exec.Command("iptables", c...).Run() // each undoes what exists of the cut
		}
	}()
	for _, c := range cmds {
		if out, err := exec.Command("iptables", c...).CombinedOutput(); err != nil {
			return 0, fmt.Errorf("iptables %v: %v %s", c, err, out)
		}
	}
	select {
	case <-time.After(down):
	case <-ctx.Done():
		return cut, ctx.Err()
	}
	return cut, nil
}

// tcpPorts are the local TCP ports of the sockets the processes hold, from /proc.
func tcpPorts(pids []int) ([]string, error) {
	inodes := map[string]bool{}
	for _, pid := range pids {
		fds, _ := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
		for _, fd := range fds {
			if l, err := os.Readlink(fmt.Sprintf("/proc/%d/fd/%s", pid, fd.Name())); err == nil {
				if ino, ok := strings.CutPrefix(l, "socket:["); ok {
					inodes[strings.TrimSuffix(ino, "]")] = true
				}
			}
		}
	}
	seen := map[string]bool{}
	var ports []string
	for _, table := range []string{"tcp", "tcp6"} {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/net/%s", pids[0], table))
		if err != nil {
			return nil, err
		}
		for _, line := range strings.Split(string(b), "\n")[1:] {
			f := strings.Fields(line)
			if len(f) < 10 || !inodes[f[9]] {
				continue
			}
			_, hex, _ := strings.Cut(f[1], ":") // local_address is ADDR:PORT in hex
			port, err := strconv.ParseUint(hex, 16, 16)
			if err == nil && !seen[hex] {
				seen[hex] = true
				ports = append(ports, strconv.FormatUint(port, 10))
			}
		}
	}
	return ports, nil
}

// StopAPIServer takes the node's API server away for down, as a control-plane outage
// does: SIGKILL (its graceful shutdown waits for long requests, over 30 s here), then,
// down after the kill, the same binary with the same flags again; it returns once the API
// server serves. Everything else keeps running: what serves requests must not need it.
func (n *Node) StopAPIServer(ctx context.Context, down time.Duration) error {
	if n.external {
		return errors.New("stopping the API server: the cluster is not this machine's")
	}
	i := slices.IndexFunc(n.procs, func(p *proc) bool { return p.name == "kube-apiserver" })
	if i < 0 {
		return errors.New("the node runs no kube-apiserver")
	}
	old := n.procs[i]
	back := time.NewTimer(down)
	defer back.Stop()
	_ = syscall.Kill(-old.cmd.Process.Pid, syscall.SIGKILL)
	<-old.exited
	select {
	case <-back.C:
	case <-ctx.Done():
		return ctx.Err()
	}
	n.procs = slices.Delete(n.procs, i, i+1)
	if err := n.run(old.name, old.cmd.Path, old.cmd.Args[1:]...); err != nil {
		return err
	}
	return n.until(ctx, "the API server to serve again", func(ctx context.Context) bool {
		return n.Client.List(ctx, &corev1.NamespaceList{}) == nil
	})
}

// PodMetrics reads a pod's /metrics on port (plain HTTP) through the API server: every
// series, named with its labels as exposed, and its value.
func (n *Node) PodMetrics(namespace, pod string, port int) (map[string]float64, error) {
	url := n.PodURL(namespace, pod, port, "/metrics")
	resp, err := n.HTTPClient(url, 10*time.Second).Get(url)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, err
	}
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("%s/%s: %s: %s", namespace, pod, resp.Status, b)
	}
	out := map[string]float64{}
	for _, line := range strings.Split(string(b), "\n") {
		i := strings.LastIndexByte(line, ' ')
		if line == "" || line[0] == '#' || i < 0 {
			continue
		}
		var v float64
		if _, err := fmt.Sscan(line[i+1:], &v); err == nil {
			out[line[:i]] = v
		}
	}
	return out, nil
}

// Sum adds the series of metrics that are name: name itself with its labels, or, for a
// name without labels, every series of that name.
func Sum(metrics map[string]float64, name string) float64 {
	var sum float64
	for series, v := range metrics {
		if rest, ok := strings.CutPrefix(series, name); ok && (rest == "" || !strings.HasSuffix(name, "}") && strings.HasPrefix(rest, "{")) {
			sum += v
		}
	}
	return sum
}

// ContainerCPU is the CPU time a pod's running container's processes have used so far
// (user and system, every thread), read from /proc on this machine.
func (n *Node) ContainerCPU(ctx context.Context, namespace, pod, container string) (time.Duration, error) {
	threads, err := n.ContainerThreadsCPU(ctx, namespace, pod, container)
	var total time.Duration
	for _, d := range threads {
		total += d
	}
	return total, err
}

// ContainerThreadsCPU is the CPU time each thread of a pod's running container has used
// so far, keyed "<command> <pid>/<tid>" (the thread's own name, as the kernel has it).
func (n *Node) ContainerThreadsCPU(ctx context.Context, namespace, pod, container string) (map[string]time.Duration, error) {
	pids, err := n.containerPIDs(ctx, namespace, pod, container)
	if err != nil {
		return nil, err
	}
	out := map[string]time.Duration{}
	for _, pid := range pids {
		tasks, _ := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/stat", pid))
		for _, task := range tasks { // a thread or process gone since is skipped
			b, err := os.ReadFile(task)
			if err != nil {
				continue
			}
			// The command is in parentheses; utime and stime are the 12th and 13th
			// fields after it (the 14th and 15th of the line).
			head, rest, _ := strings.Cut(string(b), ") ")
			_, comm, _ := strings.Cut(head, " (")
			f := strings.Fields(rest)
			if len(f) < 13 {
				return nil, fmt.Errorf("%s: %d fields after the command", task, len(f))
			}
			var ticks int64
			for _, s := range f[11:13] {
				v, err := strconv.ParseInt(s, 10, 64)
				if err != nil {
					return nil, fmt.Errorf("%s: %w", task, err)
				}
				ticks += v
			}
			tid := filepath.Base(filepath.Dir(task))
			// USER_HZ is 100 on every Linux architecture Go supports.
			out[fmt.Sprintf("%s %d/%s", comm, pid, tid)] = time.Duration(ticks) * 10 * time.Millisecond
		}
	}
	return out, nil
}
