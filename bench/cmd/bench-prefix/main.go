// Command bench-prefix runs the prefix-aware routing benchmark (make bench-prefix):
// multi-turn conversations sharing a system prompt, through the router binary to
// simulated engines with prefix caches and two transfer agents, load-only against
// prefix-aware routing in push and pull; it prints a markdown table and writes
// bench/results/prefix/prefix.json and prefix.md.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"

	"github.com/kvhandoff/kvhandoff/bench/prefix"
	"github.com/kvhandoff/kvhandoff/test/agentproc"
	"github.com/kvhandoff/kvhandoff/test/gobin"
)

func main() {
	sc := prefix.Default()
	flag.IntVar(&sc.Conversations, "conversations", sc.Conversations, "conversations, each of -turns turns")
	flag.IntVar(&sc.Turns, "turns", sc.Turns, "turns of each conversation")
	flag.Float64Var(&sc.Rate, "rate", sc.Rate, "conversations starting a second (Poisson)")
	flag.IntVar(&sc.Decodes, "decodes", sc.Decodes, "decode engines")
	flag.IntVar(&sc.CacheBlocks, "cache-blocks", sc.CacheBlocks, "each engine's prefix cache, in 16-token blocks")
	out := flag.String("out", "bench/results/prefix", "folder for prefix.json and prefix.md")
	flag.Parse()
	if err := run(sc, *out); err != nil {
		fmt.Fprintln(os.Stderr, "bench-prefix:", err)
		os.Exit(1)
	}
}

func run(sc prefix.Scenario, out string) error {
	work, err := os.MkdirTemp("", "kvhandoff-prefix")
	if err != nil {
		return err
	}
	defer os.RemoveAll(work)
	if sc.AgentBin, err = agentproc.Build(work); err != nil {
		return err
	}
	if sc.RouterBin, err = gobin.Build(work, "router"); err != nil {
		return err
	}
	sc.WorkDir, sc.Log = work, os.Stderr
	rep, err := prefix.Run(context.Background(), sc)
	if err != nil {
		return err
	}
	rep.Markdown(os.Stdout)
	return rep.Write(out)
}
