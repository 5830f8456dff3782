// Command bench-serving runs the serving benchmark (make bench-serving): requests through
// the router to simulated engines and two transfer agents, push and pull on the same
// seeded arrivals; it prints a markdown table and writes bench/results/serving.json and
// serving.png.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"path/filepath"

	"github.com/kvhandoff/kvhandoff/bench/serving"
	"github.com/kvhandoff/kvhandoff/test/agentproc"
	"github.com/kvhandoff/kvhandoff/test/gobin"
)

func main() {
	sc := serving.Default()
	sc.Load.Flags(flag.CommandLine)
	flag.IntVar(&sc.KVBytesPerToken, "kv-bytes-per-token", sc.KVBytesPerToken, "KV bytes per token over all ranks (Qwen3-32B's shape, head "+
		"dimension scaled; the real model's is 262144)")
	out := flag.String("out", "bench/results", "folder for serving.json and serving.png")
	flag.StringVar(&sc.AgentBin, "agent-bin", "", "a prebuilt transfer-agent binary (default: build one)")
	flag.StringVar(&sc.RouterBin, "router-bin", "", "a prebuilt router binary (default: build one)")
	flag.Parse()
	if err := run(sc, *out); err != nil {
		fmt.Fprintln(os.Stderr, "bench-serving:", err)
		os.Exit(1)
	}
}

func run(sc serving.Scenario, out string) error {
	work, err := os.MkdirTemp(shm(), "kvhandoff-serving")
	if err != nil {
		return err
	}
	defer os.RemoveAll(work)
	if sc.AgentBin == "" {
		if sc.AgentBin, err = agentproc.Build(work); err != nil {
			return err
		}
	}
	if sc.RouterBin == "" {
		if sc.RouterBin, err = gobin.Build(work, "router"); err != nil {
			return err
		}
	}
	ctx := context.Background()
	sc.WorkDir, sc.Log = work, os.Stderr
	rep, err := serving.Run(ctx, sc)
	if err != nil {
		return err
	}
	rep.Markdown(os.Stdout)
	if err := rep.Write(out); err != nil {
		return err
	}
	fmt.Fprintf(os.Stderr, "wrote %s and %s\n", filepath.Join(out, "serving.json"), filepath.Join(out, "serving.png"))
	return nil
}

// shm is where the agents' sockets and the engines' KV files go: shared memory when the
// machine has it, so the simulated caches live in RAM as real ones do.
func shm() string {
	if st, err := os.Stat("/dev/shm"); err == nil && st.IsDir() {
		return "/dev/shm"
	}
	return ""
}
