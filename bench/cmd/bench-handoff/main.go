// Command bench-handoff runs the push-versus-pull handoff benchmark (make bench-handoff):
// it prints a markdown table and writes bench/results/handoff.json and handoff.png.
// With --demo it pushes one verified request through two agents instead (make demo).
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"

	"github.com/kvhandoff/kvhandoff/bench/handoff"
	"github.com/kvhandoff/kvhandoff/test/agentproc"
)

func main() {
	sc := handoff.Default()
	sc.Load.Flags(flag.CommandLine)
	flag.Float64Var(&sc.LoadFraction, "load", sc.LoadFraction, "offered load as a fraction of the measured bandwidth")
	flag.StringVar(&sc.Fabtests, "fabtests", "", "a fabtests install (hack/fabtests.sh): measure the agent's write throughput beside its fi_rma_bw")
	flag.IntVar(&sc.Rails, "rails", sc.Rails, "endpoints per engine rank (the agents' --rails) and per floor pair")
	flag.IntVar(&sc.LayerGroups, "layer-groups", sc.LayerGroups, "layer groups push-layered reports a request in (0: skip that mode)")
	out := flag.String("out", "bench/results", "folder for handoff.json and handoff.png")
	fixed := flag.Int("fixed-cost", 0, "instead of the benchmark, time this many handoffs of a few blocks along each path (push, pull; gRPC, doorbell): "+
		"the cost of a handoff beyond its bytes; writes fixed-cost.json")
	fixedGPU := flag.Int("fixed-cost-gpu", -1, "with --fixed-cost: keep both engines' KV on this GPU, one agent moving it by CUDA copies")
	tpPairs := flag.Int("tp-pairs", 0, "instead of the benchmark, time this many handoffs of one request between engines of TP8→TP8, TP8→TP4 "+
		"and TP2→TP8 (--tp-pairs-tokens tokens each); writes tp-pairs.json")
	tpTokens := flag.Int("tp-pairs-tokens", 1024, "with --tp-pairs: the request's tokens")
	demo := flag.Bool("demo", false, "instead of the benchmark, push one verified request through two agents (make demo)")
	flag.StringVar(&agentBin, "agent-bin", "", "a prebuilt transfer-agent binary (default: build one)")
	flag.StringVar(&sc.AgentCPUs, "agent-cpus", "", "run the agents (and the floors) on these CPUs (taskset's list, e.g. 0-7) and the simulated "+
		"engines on the others")
	flag.Parse()
	if sc.AgentCPUs != "" {
		if err := onOtherCPUs(sc.AgentCPUs); err != nil {
			fmt.Fprintln(os.Stderr, "bench-handoff:", err)
			os.Exit(1)
		}
	}
	run := run
	if *demo {
		run = runDemo
	}
	if *fixed > 0 {
		run = func(sc handoff.Scenario, out string) error { return runFixedCost(sc, out, *fixed, *fixedGPU) }
	}
	if *tpPairs > 0 {
		run = func(sc handoff.Scenario, out string) error { return runTPPairs(sc, out, *tpPairs, *tpTokens) }
	}
	if err := run(sc, *out); err != nil {
		fmt.Fprintln(os.Stderr, "bench-handoff:", err)
		os.Exit(1)
	}
}

var agentBin string

// pinnedEnv marks the process already running on the CPUs the agents leave.
const pinnedEnv = "KVHANDOFF_BENCH_PINNED"

// onOtherCPUs runs this command again under taskset on the CPUs that agentCPUs leaves,
// so every thread of the simulated engines (which fill and verify the KV) stays off the
// agents' cores; it returns only in the re-run process.
func onOtherCPUs(agentCPUs string) error {
	if os.Getenv(pinnedEnv) != "" {
		return nil
	}
	set, err := handoff.ParseCPUs(agentCPUs)
	if err != nil {
		return fmt.Errorf("--agent-cpus: %w", err)
	}
	others := handoff.OtherCPUs(set)
	if others == "" {
		return fmt.Errorf("--agent-cpus %s leaves no CPU for the simulated engines", agentCPUs)
	}
	self, err := os.Executable()
	if err != nil {
		return err
	}
	cmd := exec.Command("taskset", append([]string{"-c", others, self}, os.Args[1:]...)...)
	cmd.Env = append(os.Environ(), pinnedEnv+"=1")
	cmd.Stdin, cmd.Stdout, cmd.Stderr = os.Stdin, os.Stdout, os.Stderr
	if err := cmd.Run(); err != nil {
		var exit *exec.ExitError
		if errors.As(err, &exit) {
			os.Exit(exit.ExitCode())
		}
		return err
	}
	os.Exit(0)
	return nil
}

// agent returns the agent binary to run: --agent-bin, or one built into work.
func agent(work string) (string, error) {
	if agentBin != "" {
		return agentBin, nil
	}
	return agentproc.Build(work)
}

func run(sc handoff.Scenario, out string) error {
	work, err := workDir()
	if err != nil {
		return err
	}
	defer os.RemoveAll(work)
	if sc.AgentBin, err = agent(work); err != nil {
		return err
	}
	sc.WorkDir, sc.Log = work, os.Stderr
	rep, err := handoff.Run(context.Background(), sc)
	if err != nil {
		return err
	}
	rep.Markdown(os.Stdout)
	if err := rep.Write(out); err != nil {
		return err
	}
	fmt.Fprintf(os.Stderr, "wrote %s and %s\n", filepath.Join(out, "handoff.json"), filepath.Join(out, "handoff.png"))
	return nil
}

func runDemo(sc handoff.Scenario, _ string) error {
	return withAgent(func(work, bin string) error {
		return handoff.Demo(context.Background(), bin, work, sc.Provider, os.Stdout)
	})
}

func runFixedCost(sc handoff.Scenario, out string, n, gpu int) error {
	return withAgent(func(work, bin string) error {
		rep, err := handoff.FixedCost(context.Background(), bin, work, sc.Provider, n, gpu)
		if err != nil {
			return err
		}
		rep.Markdown(os.Stdout)
		return rep.Write(out)
	})
}

func runTPPairs(sc handoff.Scenario, out string, n, tokens int) error {
	return withAgent(func(work, bin string) error {
		rep, err := handoff.TPPairs(context.Background(), bin, work, sc.Provider, [][2]int{{8, 8}, {8, 4}, {2, 8}}, tokens, n)
		if err != nil {
			return err
		}
		rep.Markdown(os.Stdout)
		return rep.Write(out)
	})
}

// withAgent runs fn with a scratch folder and the agent binary to run.
func withAgent(fn func(work, bin string) error) error {
	work, err := workDir()
	if err != nil {
		return err
	}
	defer os.RemoveAll(work)
	bin, err := agent(work)
	if err != nil {
		return err
	}
	return fn(work, bin)
}

// workDir is where the agents' sockets and the engines' KV files go: shared memory when
// the machine has it, so the simulated caches live in RAM as real ones do.
func workDir() (string, error) {
	if st, err := os.Stat("/dev/shm"); err == nil && st.IsDir() {
		return os.MkdirTemp("/dev/shm", "kvhandoff-bench")
	}
	return os.MkdirTemp("", "kvhandoff-bench")
}
