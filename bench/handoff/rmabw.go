package handoff

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/kvhandoff/kvhandoff/test/agentproc"
	"github.com/kvhandoff/kvhandoff/test/loopback"
	"github.com/kvhandoff/kvhandoff/test/simengine"
	agentv1 "github.com/kvhandoff/kvhandoff/transferagent/api/v1"
)

// Throughput sets the agent's RMA write throughput beside fabtests' fi_rma_bw, measured
// on the same provider, libfabric and machine, with the same message size and window:
// one window of Window writes of MessageBytes each, drained before the next (how
// fi_rma_bw paces its windows, and how one rank's share of a push request goes out: one
// merged write per region, of the request's blocks).
type Throughput struct {
	// Libfabric is the library both ran on, as the agent reported it.
	Libfabric    string  `json:"libfabric"`
	MessageBytes int     `json:"message_bytes"`
	Window       int     `json:"window"`
	FiRmaBwGBps  float64 `json:"fi_rma_bw_gb_per_s"`
	// AgentGBps is what an engine sees: the bytes over SourceReady → DELIVERED.
	AgentGBps float64 `json:"agent_gb_per_s"`
	// AgentWritesGBps is the agent's writes alone: the bytes over its post and wire
	// stages (pairing until the last write completed), without the engine's calls, the
	// delivery signal and the event back — where the rest of the gap to fi_rma_bw is.
	AgentWritesGBps float64 `json:"agent_writes_gb_per_s"`
	// FailedRequests are the agents' requests that failed, with their reasons (left out
	// of the rates).
	FailedRequests []string `json:"failed_requests,omitempty"`
	// AgentOverFiRmaBw is the target's ratio (≥ 0.95).
	AgentOverFiRmaBw float64 `json:"agent_over_fi_rma_bw"`
	// AgentInstalledGBps is the agent on the machine's own libfabric, for context.
	AgentInstalledGBps float64 `json:"agent_on_installed_libfabric_gb_per_s"`
	Installed          string  `json:"installed_libfabric"`
	// The machine's busy CPU time per GB moved (every process and the kernel, from
	// /proc/stat) for fi_rma_bw sleeping in the provider as the agents do (-c sread; spun,
	// it keeps two cores busy whatever it moves) and for the agent end to end: where the
	// machine has few cores, a data path that needs more CPU per byte runs out of CPU
	// before it runs out of wire.
	FiRmaBwSreadGBps     float64 `json:"fi_rma_bw_sread_gb_per_s"`
	FiRmaBwSreadCPUPerGB float64 `json:"fi_rma_bw_sread_cpu_s_per_gb"`
	AgentCPUPerGB        float64 `json:"agent_cpu_s_per_gb"`
	CPUs                 int     `json:"cpus"`
}

// throughputWindows is how many windows each side moves.
const throughputWindows = 100

// MeasureThroughput runs fi_rma_bw from fabtests (an install prefix with bin/ and lib/,
// built by hack/fabtests.sh) and the agent on that prefix's libfabric, then the agent on
// the installed one. l is one rank's layout, with Blocks the blocks of one request.
func MeasureThroughput(ctx context.Context, sc Scenario, fabtests string, l simengine.Layout) (*Throughput, error) {
	// Its libfabric first; what else it links comes from the path as it is.
	lib := "LD_LIBRARY_PATH=" + strings.TrimSuffix(filepath.Join(fabtests, "lib")+":"+os.Getenv("LD_LIBRARY_PATH"), ":")
	th := &Throughput{MessageBytes: l.Blocks * l.BlockBytes(), Window: l.Regions(), CPUs: runtime.NumCPU()}
	var err error
	iters := th.Window * throughputWindows
	if th.FiRmaBwGBps, _, err = fiRmaBw(ctx, fabtests, lib, sc, th.MessageBytes, th.Window, iters); err != nil {
		return nil, err
	}
	// Its CPU per GB is the difference between a run and one three times as long, which
	// leaves out what starting, connecting and ending cost.
	_, short, err := fiRmaBw(ctx, fabtests, lib, sc, th.MessageBytes, th.Window, iters, "-c", "sread")
	if err != nil {
		return nil, err
	}
	var long time.Duration
	if th.FiRmaBwSreadGBps, long, err = fiRmaBw(ctx, fabtests, lib, sc, th.MessageBytes, th.Window, 3*iters, "-c", "sread"); err != nil {
		return nil, err
	}
	th.FiRmaBwSreadCPUPerGB = (long - short).Seconds() / (float64(th.MessageBytes) * float64(2*iters) / 1e9)
	onFabtests, err := agentThroughput(ctx, sc, []string{lib}, l)
	if err != nil {
		return nil, err
	}
	th.AgentGBps, th.AgentWritesGBps, th.Libfabric, th.AgentCPUPerGB = onFabtests.endToEnd, onFabtests.writes, onFabtests.libfabric, onFabtests.cpuPerGB
	installed, err := agentThroughput(ctx, sc, nil, l)
	if err != nil {
		return nil, err
	}
	th.AgentInstalledGBps, th.Installed = installed.endToEnd, installed.libfabric
	th.FailedRequests = append(onFabtests.failed, installed.failed...)
	th.AgentOverFiRmaBw = th.AgentGBps / th.FiRmaBwGBps
	return th, nil
}

// fiRmaBw runs fi_rma_bw's server and client on a loopback host of their own (unidirectional writedata,
// like a push) for iters writes, with extra options, and returns the client's GB/s and the
// machine's busy CPU time over the client's run.
func fiRmaBw(ctx context.Context, fabtests, lib string, sc Scenario, size, window, iters int, extra ...string) (gbps float64, busy time.Duration, err error) {
	// The server's address exchange listens on the host's fabtests port (9228, its default).
	host, err := loopback.Claim()
	if err != nil {
		return 0, 0, err
	}
	defer host.Release()
	bin := filepath.Join(fabtests, "bin", "fi_rma_bw")
	args := []string{"-p", sc.Provider, "-e", "rdm", "-o", "writedata", "-S", strconv.Itoa(size),
		"-W", strconv.Itoa(window), "-I", strconv.Itoa(iters), "-E=9228"}
	args = append(args, extra...)
	ctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	command := func(args ...string) *exec.Cmd {
		if sc.AgentCPUs != "" { // on the agents' CPUs, like with like
			return exec.CommandContext(ctx, "taskset", append([]string{"-c", sc.AgentCPUs, bin}, args...)...)
		}
		return exec.CommandContext(ctx, bin, args...)
	}
	server := command(append(args, "-s", host.IP)...)
	server.Env = append(server.Environ(), lib)
	var serverOut strings.Builder
	server.Stdout, server.Stderr = &serverOut, &serverOut
	if err := server.Start(); err != nil {
		return 0, 0, fmt.Errorf("fi_rma_bw: %w", err)
	}
	defer func() { _ = server.Wait() }()
	// The client fails at once while the server is not yet listening: try again.
	var out []byte
	for attempt := 0; ; attempt++ {
		client := command(append(args, host.IP)...)
		client.Env = append(client.Environ(), lib)
		before := cpuBusy()
		if out, err = client.CombinedOutput(); err == nil {
			busy = cpuBusy() - before
			break
		}
		if attempt == 50 || ctx.Err() != nil {
			return 0, 0, fmt.Errorf("fi_rma_bw client: %v\n%s\nserver:\n%s", err, out, serverOut.String())
		}
		time.Sleep(100 * time.Millisecond)
	}
	gbps, err = parseFiRmaBw(string(out))
	return gbps, busy, err
}

// cpuBusy is the machine's busy CPU time so far, every CPU summed (/proc/stat's first
// line, in USER_HZ, which Linux fixes at 100 for it): around a measurement it counts the
// kernel's TCP copies wherever they ran, which per-process times miss. 0 where there is
// no /proc/stat.
func cpuBusy() time.Duration {
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return 0
	}
	line, _, _ := strings.Cut(string(b), "\n")
	f := strings.Fields(line)
	var jiffies int64
	for i, v := range f[1:] {
		n, _ := strconv.ParseInt(v, 10, 64)
		switch i {
		case 3, 4, 8, 9: // idle, iowait; guest time is already in user
		default:
			jiffies += n
		}
	}
	return time.Duration(jiffies) * 10 * time.Millisecond
}

// parseFiRmaBw reads the MB/sec column (10^6 bytes) of fi_rma_bw's result line.
func parseFiRmaBw(out string) (float64, error) {
	lines := strings.Split(strings.TrimSpace(out), "\n")
	for i, l := range lines {
		head := strings.Fields(l)
		col := -1
		for j, h := range head {
			if h == "MB/sec" {
				col = j
			}
		}
		if col < 0 || i+1 >= len(lines) {
			continue
		}
		row := strings.Fields(lines[i+1])
		if col >= len(row) {
			break
		}
		mb, err := strconv.ParseFloat(row[col], 64)
		if err != nil {
			break
		}
		return mb / 1000, nil
	}
	return 0, fmt.Errorf("fi_rma_bw: no MB/sec in its output:\n%s", out)
}

var libfabricVersion = regexp.MustCompile(`"libfabric":"([^"]+)"`)

// agentRate is the agent's throughput in GB/s, measured two ways, and the libfabric it
// ran on.
type agentRate struct {
	endToEnd, writes, cpuPerGB float64
	libfabric                  string
	// failed are the requests the agents reported failed, each with its reason: left out
	// of the rates, reported beside them.
	failed []string
}

// agentThroughput pushes requests through two agents (run with env), one rank of layout
// l, each request one window: every region written with one write of all l.Blocks
// blocks. It measures the bytes over the time from SourceReady to DELIVERED, summed over
// the requests, and over the prefill agent's own post and wire stages.
func agentThroughput(ctx context.Context, sc Scenario, env []string, l simengine.Layout) (rate agentRate, err error) {
	a, b, err := agentproc.StartPairWith(sc.AgentBin, filepath.Join(sc.WorkDir, fmt.Sprintf("throughput-%d", len(env))), sc.Provider,
		agentproc.Options{Env: env, CPUs: sc.AgentCPUs, Flags: sc.agents().Flags})
	if err != nil {
		return rate, err
	}
	defer a.Stop()
	defer b.Stop()
	defer func() {
		if err != nil { // what the agents said and counted, for a measurement that could not finish
			err = fmt.Errorf("%w\n%s's log:\n%s\n%s's log:\n%s\n%s's metrics:\n%s\n%s's metrics:\n%s",
				err, a.Name, a.Log(), b.Name, b.Log(), a.Name, agentMetrics(a), b.Name, agentMetrics(b))
		}
	}()
	version := ""
	if m := libfabricVersion.FindStringSubmatch(a.Log()); m != nil {
		version = m[1]
	}
	n := l.Blocks // fresh allocators hand out one contiguous run: one write per region
	var engines []*simengine.Engine
	defer func() {
		for _, e := range engines {
			e.Stop()
		}
	}()
	for _, x := range []struct {
		p    *agentproc.Proc
		role agentv1.Role
	}{{a, agentv1.Role_ROLE_PREFILL}, {b, agentv1.Role_ROLE_DECODE}} {
		e, err := simengine.Start(ctx, simengine.Config{ID: "throughput-" + strings.ToLower(x.role.String()), Role: x.role,
			Mode: agentv1.Mode_MODE_PUSH, Layout: l, Socket: x.p.Socket})
		if err != nil {
			return rate, err
		}
		engines = append(engines, e)
	}
	P, D := engines[0], engines[1]
	src, err := P.Allocate(n)
	if err != nil {
		return rate, err
	}
	dst, err := D.Allocate(n)
	if err != nil {
		return rate, err
	}
	var bytes float64
	var took, busy time.Duration
	var before map[string]float64
	for i := range throughputWindows + 1 {
		req := fmt.Sprintf("throughput-%d", i)
		if i == 0 {
			P.Cache.Fill(req, src) // the first, a warm-up, is also checked byte for byte
		}
		if err := D.RegisterDestination(ctx, req, 1, dst, P.Self); err != nil {
			return rate, err
		}
		start, busyStart := time.Now(), cpuBusy()
		if err := P.SourceReady(ctx, req, 0, src, true); err != nil {
			return rate, err
		}
		wctx, cancel := context.WithTimeout(ctx, waitLimit)
		ev, err := D.Wait(wctx, req, 1)
		cancel()
		if err != nil {
			return rate, err
		}
		// A request the agents report failed is an outcome, not a broken measurement: it is
		// counted and named in the report, and left out of the rate. (On tcp;ofi_rxm 1.17
		// beside a CPU hog, about one run in ten loses one request's delivery signal
		// between the provider's send and the decode side's completion queue; decode
		// reports it after its registration timeout, as it must.)
		failed := ev.Type != agentv1.Event_DELIVERED
		if failed {
			if i == 0 {
				return rate, fmt.Errorf("%s: %s: %s", req, ev.Type, ev.Reason)
			}
			rate.failed = append(rate.failed, fmt.Sprintf("%s: %s: %s", req, ev.Type, ev.Reason))
		}
		end, busyEnd := time.Now(), cpuBusy()
		wctx, cancel = context.WithTimeout(ctx, waitLimit)
		_, err = P.Wait(wctx, req, 1) // SOURCE_DONE: the blocks are the source's again
		cancel()
		if err != nil {
			return rate, err
		}
		if i == 0 {
			if err := D.Cache.Verify(req, dst); err != nil {
				return rate, err
			}
			before = scrape(a) // its stages are recorded by SOURCE_DONE
			continue
		}
		if failed {
			continue
		}
		bytes += float64(n * l.BlockBytes() * l.Regions())
		took += end.Sub(start)
		busy += busyEnd - busyStart
	}
	after := scrape(a)
	var writing float64
	for _, stage := range []string{"post", "wire"} {
		series := fmt.Sprintf(`kvhandoff_agent_handoff_stage_seconds_sum{mode="push",stage="%s"}`, stage)
		writing += after[series] - before[series]
	}
	rate = agentRate{endToEnd: bytes / took.Seconds() / 1e9, cpuPerGB: busy.Seconds() / (bytes / 1e9), libfabric: version, failed: rate.failed}
	if writing > 0 {
		rate.writes = bytes / writing / 1e9
	}
	return rate, nil
}

// agentMetrics is the kvhandoff series an agent exposes, one per line.
func agentMetrics(p *agentproc.Proc) string {
	m, err := p.Metrics()
	if err != nil {
		return err.Error()
	}
	var keep []string
	for series, v := range m {
		if strings.HasPrefix(series, "kvhandoff_") {
			keep = append(keep, fmt.Sprintf("%s %g", series, v))
		}
	}
	slices.Sort(keep)
	return strings.Join(keep, "\n")
}
