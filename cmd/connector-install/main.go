// Command connector-install copies kvhandoff's vLLM connector into the folder given as its
// argument: the init container of engines of a policy with executor Agent. It copies
// itself there too, as kvhandoff-drain: the engine container's preStop hook, which
// returns once the engine has nothing in flight (package drain).
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"
	"time"

	"github.com/kvhandoff/kvhandoff/internal/drain"
	vllmconnector "github.com/kvhandoff/kvhandoff/vllm-connector"
)

// drainName is the name the hook runs this binary by.
const drainName = "kvhandoff-drain"

func main() {
	if filepath.Base(os.Args[0]) == drainName {
		os.Exit(runDrain(os.Args[1:]))
	}
	if len(os.Args) != 2 {
		fmt.Fprintln(os.Stderr, "usage: install DIR")
		os.Exit(2)
	}
	dir := os.Args[1]
	if err := vllmconnector.Install(dir); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	if err := installSelf(filepath.Join(dir, drainName)); err != nil {
		fmt.Fprintln(os.Stderr, "installing the drain hook:", err)
		os.Exit(1)
	}
	fmt.Println("kvhandoff vLLM connector and drain hook installed in", dir)
}

// installSelf copies this (static) binary to path, executable and read-only.
func installSelf(path string) error {
	exe, err := os.Executable()
	if err != nil {
		return err
	}
	in, err := os.Open(exe)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.OpenFile(path, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o555)
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return err
	}
	return out.Close()
}

func runDrain(args []string) int {
	fs := flag.NewFlagSet(drainName, flag.ContinueOnError)
	c := drain.Config{Log: os.Stdout}
	fs.StringVar(&c.MetricsURL, "metrics", "http://127.0.0.1:8000/metrics", "the engine's Prometheus endpoint")
	fs.StringVar(&c.HeldFile, "held", "", "the connector's count of requests holding blocks for a transfer")
	fs.DurationVar(&c.Quiet, "quiet", 2*time.Second, "how long the engine must stay idle")
	fs.DurationVar(&c.Every, "every", 200*time.Millisecond, "how often it is checked")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	if err := drain.Wait(ctx, c); err != nil {
		fmt.Fprintln(os.Stderr, "drain:", err)
		return 1
	}
	fmt.Println("drain: the engine is idle")
	return 0
}
