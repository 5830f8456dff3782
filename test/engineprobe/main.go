// Command engineprobe is a hostile engine for the agent's tests: run as a user or in a
// pod other than the victim's, it tries what a compromised engine on the node would, and
// prints what the agent answered, one line: the gRPC code (OK when it was let through)
// and the message. The commands that hold something (hold-calls, hold-memory) print
// their line once they hold it and keep holding until their stdin closes.
//
//	engineprobe --socket S register ENGINE_ID [REPLACES_SESSION]
//	engineprobe --socket S heartbeat SESSION
//	engineprobe --socket S deposit SESSION
//	engineprobe --socket S hold-calls N     N calls that never send their request, then one more
//	engineprobe --socket S hold-memory N    N memory socket connections
//	engineprobe --socket S hold-sessions N  N engine ranks registered, each with its event stream open
//	engineprobe --socket S replace          remove the engine socket and bind one of its own there
//	engineprobe --socket S flood N          N concurrent calls of nearly 2 MiB each (the agent's request limit)
//	engineprobe --socket S register-on ENGINE_ID DOMAIN,...  register naming its rails' NICs (fabric_domains)
//	engineprobe --socket S register-rails ENGINE_ID I        register on accelerator I's EFAs, from KVHANDOFF_ACCELERATOR_EFAS
//	engineprobe processes                   print its uid and the pids it can see
//	engineprobe devices                     print its device nodes and the device variables, then run until SIGTERM
//	engineprobe linger                      run until SIGTERM
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	agentv1 "github.com/kvhandoff/kvhandoff/transferagent/api/v1"
	"github.com/kvhandoff/kvhandoff/transferagent/client"
)

func main() {
	socket := flag.String("socket", client.DefaultSocket, "the agent's engine socket")
	flag.Parse()
	args := flag.Args()
	if len(args) == 1 && args[0] == "processes" {
		// What an engine can see of the node's processes: its uid and the pids in its /proc.
		fmt.Println("uid", os.Getuid(), "pids", processes())
		return
	}
	if len(args) == 1 && args[0] == "devices" {
		// What a DRA driver's CDI spec gave the container: its device nodes and variables.
		fmt.Println(devices())
		args[0] = "linger"
	}
	if len(args) == 1 && args[0] == "linger" {
		// An engine that runs until its pod is deleted, for another to look for.
		ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM)
		defer stop()
		<-ctx.Done()
		return
	}
	if len(args) == 1 && args[0] == "replace" {
		// What a root engine beside a writable socket folder did: every engine of the node
		// would then connect to the intruder.
		err := os.Remove(*socket)
		if err == nil {
			_, err = net.Listen("unix", *socket)
		}
		answer(err)
		return
	}
	if len(args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: engineprobe --socket S COMMAND ARG")
		os.Exit(2)
	}
	conn, err := grpc.NewClient("unix://"+*socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	defer conn.Close()
	api := agentv1.NewAgentClient(conn)
	ctx := context.Background()
	switch args[0] {
	case "register":
		r := &agentv1.RegisterEngineRequest{EngineId: args[1], Role: agentv1.Role_ROLE_DECODE, Mode: agentv1.Mode_MODE_PUSH, TpSize: 1,
			Layout: &agentv1.KVLayout{Layers: 1, BlockSize: 16, KvHeads: 8, HeadDim: 16, DtypeBytes: 2}}
		if len(args) > 2 {
			r.ReplacesSession = args[2]
		}
		_, err := api.RegisterEngine(ctx, r)
		answer(err)
	case "register-on", "register-rails":
		r := &agentv1.RegisterEngineRequest{EngineId: args[1], Role: agentv1.Role_ROLE_DECODE, Mode: agentv1.Mode_MODE_PUSH, TpSize: 1,
			Layout: &agentv1.KVLayout{Layers: 1, BlockSize: 16, KvHeads: 8, HeadDim: 16, DtypeBytes: 2}}
		if len(args) > 2 {
			r.FabricDomains = strings.Split(args[2], ",")
		}
		if args[0] == "register-rails" {
			// The RDMA device names themselves: the agent's provider here is not efa, whose
			// domains would be <name>-rdm.
			groups := strings.Split(os.Getenv("KVHANDOFF_ACCELERATOR_EFAS"), ";")
			i, _ := strconv.Atoi(args[2])
			if i >= len(groups) {
				answer(fmt.Errorf("KVHANDOFF_ACCELERATOR_EFAS has %d accelerators", len(groups)))
				return
			}
			_, efas, _ := strings.Cut(groups[i], "=")
			r.FabricDomains = strings.Split(efas, ",")
		}
		_, err := api.RegisterEngine(ctx, r)
		answer(err)
	case "heartbeat":
		_, err := api.Heartbeat(ctx, &agentv1.HeartbeatRequest{Session: args[1]})
		answer(err)
	case "deposit":
		fd, _, err := client.NewMemory("probe", 1<<16)
		if err == nil {
			_, err = client.PassMemory(agentv1.MemorySocket(*socket), args[1], fd)
		}
		answer(err)
	case "hold-calls":
		n := count(args[1])
		for range n {
			// A unary call whose request never comes: the agent's handler waits for it.
			if _, err := conn.NewStream(ctx, &grpc.StreamDesc{ClientStreams: true}, agentv1.Agent_Heartbeat_FullMethodName); err != nil {
				answer(err)
				return
			}
		}
		_, err := api.Heartbeat(ctx, &agentv1.HeartbeatRequest{Session: "none"})
		answer(err)
		hold()
	case "hold-memory":
		n, held := count(args[1]), 0
		for range n {
			conn, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: agentv1.MemorySocket(*socket), Net: "unixpacket"})
			if err != nil {
				continue
			}
			// A connection the agent serves answers a packet; one it refused is closed.
			buf := make([]byte, 256)
			if _, err := conn.Write([]byte("none")); err == nil {
				if k, err := conn.Read(buf); err == nil && k > 0 {
					held++
					defer conn.Close()
					continue
				}
			}
			conn.Close()
		}
		fmt.Printf("OK held %d of %d\n", held, n)
		hold()
	case "hold-sessions":
		n, held := count(args[1]), 0
		var last error
		for i := range n {
			r := &agentv1.RegisterEngineRequest{EngineId: fmt.Sprintf("probe-%d", i), Role: agentv1.Role_ROLE_DECODE, Mode: agentv1.Mode_MODE_PUSH, TpSize: 1,
				Layout: &agentv1.KVLayout{Layers: 1, BlockSize: 16, KvHeads: 8, HeadDim: 16, DtypeBytes: 2}}
			s, err := api.RegisterEngine(ctx, r)
			if err == nil {
				// The stream keeps the session past the agent's events deadline.
				_, err = api.Events(ctx, &agentv1.EventsRequest{Session: s.Session})
			}
			if err != nil {
				last = err
				continue
			}
			held++
		}
		fmt.Printf("OK held %d of %d; the last refusal: %v\n", held, n, status.Convert(last).Message())
		hold()
	case "flood":
		n := count(args[1])
		big := &agentv1.RegisterRegionRequest{Session: "none", BlockLen: 1, BlockCount: 1, Size: 1, CudaIpcHandle: make([]byte, 2<<20-4096)}
		codes := make(chan string, n)
		var wg sync.WaitGroup
		for range n {
			wg.Add(1)
			go func() {
				defer wg.Done()
				_, err := api.RegisterRegion(ctx, big)
				codes <- status.Code(err).String()
			}()
		}
		wg.Wait()
		close(codes)
		by := map[string]int{}
		for c := range codes {
			by[c]++
		}
		fmt.Println("OK", by)
	default:
		fmt.Fprintf(os.Stderr, "engineprobe: unknown command %q\n", args[0])
		os.Exit(2)
	}
}

func count(s string) int {
	n, err := strconv.Atoi(s)
	if err != nil || n < 1 {
		fmt.Fprintf(os.Stderr, "engineprobe: %q is not a count\n", s)
		os.Exit(2)
	}
	return n
}

// answer prints the agent's answer: OK, or the refusal's code and message.
func answer(err error) {
	switch st, ok := status.FromError(err); {
	case err == nil:
		fmt.Println("OK")
	case ok:
		fmt.Println(st.Code(), strings.ReplaceAll(st.Message(), "\n", " "))
	default:
		fmt.Println("Error", strings.ReplaceAll(err.Error(), "\n", " "))
	}
}

// hold keeps what was taken until stdin closes.
func hold() { _, _ = io.Copy(io.Discard, os.Stdin) }

// processes are the pids /proc lists, in order.
func processes() []int {
	entries, _ := os.ReadDir("/proc")
	var pids []int
	for _, e := range entries {
		if pid, err := strconv.Atoi(e.Name()); err == nil {
			pids = append(pids, pid)
		}
	}
	slices.Sort(pids)
	return pids
}

// devices is one line: the container's GPU and RDMA device nodes (those that are
// character devices), then the variables a device's CDI spec sets, sorted.
func devices() string {
	var out []string
	for _, pattern := range []string{"/dev/nvidia*", "/dev/infiniband/*", "/dev/neuron*"} {
		names, _ := filepath.Glob(pattern)
		for _, n := range names {
			if fi, err := os.Stat(n); err == nil && fi.Mode()&os.ModeCharDevice != 0 {
				out = append(out, n)
			}
		}
	}
	for _, e := range os.Environ() {
		for _, prefix := range []string{"NVIDIA_VISIBLE_DEVICES=", "AWS_NEURON_VISIBLE_DEVICES=", "KVHANDOFF_ACCELERATOR_EFAS"} {
			if strings.HasPrefix(e, prefix) {
				out = append(out, e)
			}
		}
	}
	slices.Sort(out)
	return strings.Join(out, " ")
}
