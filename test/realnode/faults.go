package realnode

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
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
	if n.external {
		return 0, fmt.Errorf("killing %s/%s's %s: the cluster is not on this machine", namespace, pod, container)
	}
	p := &corev1.Pod{}
	if err := n.Client.Get(ctx, client.ObjectKey{Namespace: namespace, Name: pod}, p); err != nil {
		return 0, err
	}
	var id string
	for _, s := range p.Status.ContainerStatuses {
		if s.Name == container && s.State.Running != nil {
			_, id, _ = strings.Cut(s.ContainerID, "://")
		}
	}
	if id == "" {
		return 0, fmt.Errorf("%s/%s has no running container %s", namespace, pod, container)
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
			break // every hierarchy holds the same processes
		}
	}
	if len(pids) == 0 {
		return 0, fmt.Errorf("no process of %s/%s's container %s (%s) under the kubelet's cgroups", namespace, pod, container, id)
	}
	for _, pid := range pids {
		if err := syscall.Kill(pid, syscall.SIGKILL); err != nil && err != syscall.ESRCH {
			return 0, fmt.Errorf("killing process %d of %s/%s: %w", pid, namespace, pod, err)
		}
	}
	return len(pids), nil
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
