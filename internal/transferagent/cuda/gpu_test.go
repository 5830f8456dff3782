//go:build gpu

package cuda

import (
	"bytes"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"testing"
	"time"
)

// The GPU tests (make test-gpu) need two GPUs that can reach each other. CUDA IPC hands an
// allocation to another process, so the importing side runs as a child: this test binary
// again, with KVH_CUDA_CHILD set.

const (
	copySize = 1 << 30 // bytes per copy round: Qwen3-32B's KV of 16k tokens on one TP-8 rank is 537 MB
	pieces   = 128     // one copy per region, as the writer merges a contiguous request
	rounds   = 10
)

func TestMain(m *testing.M) {
	switch os.Getenv("KVH_CUDA_CHILD") {
	case "":
	case "passed":
		os.Exit(passedChild())
	default:
		os.Exit(child())
	}
	os.Exit(m.Run())
}

func pattern(n int, seed byte) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(i*7+i>>12) ^ seed
	}
	return b
}

type childResult struct {
	GBps     float64 `json:"gb_per_s"`
	Verified bool    `json:"verified"`
	Err      string  `json:"error,omitempty"`
}

// child imports the parent's allocation on GPU KVH_CUDA_GPU and copies it into its own
// memory, in pieces on one stream, rounds times, timing each round to its event; then it
// checks every byte of the last round.
func child() int {
	res := childResult{}
	defer func() { _ = json.NewEncoder(os.Stdout).Encode(res) }()
	fail := func(err error) int { res.Err = err.Error(); return 0 }
	gpu, _ := strconv.Atoi(os.Getenv("KVH_CUDA_GPU"))
	raw, err := hex.DecodeString(os.Getenv("KVH_CUDA_HANDLE"))
	if err != nil || len(raw) != 64 {
		return fail(fmt.Errorf("bad handle %q", os.Getenv("KVH_CUDA_HANDLE")))
	}
	var h IPCHandle
	copy(h[:], raw)
	c, err := Open(gpu)
	if err != nil {
		return fail(err)
	}
	src, err := c.Import(h)
	if err != nil {
		return fail(err)
	}
	defer c.Unimport(src)
	dst, err := c.Alloc(copySize)
	if err != nil {
		return fail(err)
	}
	defer c.Free(dst)
	s, err := c.NewStream()
	if err != nil {
		return fail(err)
	}
	defer s.Close()
	best := time.Duration(1 << 62)
	for range rounds {
		start := time.Now()
		for i := range uint64(pieces) {
			off := i * copySize / pieces
			if err := s.Copy(dst+Ptr(off), src+Ptr(off), copySize/pieces); err != nil {
				return fail(err)
			}
		}
		e, err := s.Record()
		if err != nil {
			return fail(err)
		}
		for done := false; !done; {
			if done, err = e.Done(); err != nil {
				return fail(err)
			}
		}
		best = min(best, time.Since(start))
		e.Close()
	}
	res.GBps = copySize / best.Seconds() / 1e9
	got := make([]byte, copySize)
	if err := c.Download(got, dst); err != nil {
		return fail(err)
	}
	res.Verified = bytes.Equal(got, pattern(copySize, 0x5a))
	return 0
}

// TestIPCCopyBetweenProcessesOnTwoGPUs: an allocation on GPU 0, exported by one process,
// is imported by another on GPU 1 and copied there over the peer path, byte for byte; and
// its throughput is set beside a raw peer copy of the same bytes in one process.
func TestIPCCopyBetweenProcessesOnTwoGPUs(t *testing.T) {
	n, err := DeviceCount()
	if err != nil {
		t.Fatal(err)
	}
	// KVH_CUDA_PEER=0 runs the same test within one GPU, where only one is to be had.
	peer := 1
	if v := os.Getenv("KVH_CUDA_PEER"); v != "" {
		peer, _ = strconv.Atoi(v)
	}
	if n <= peer {
		t.Fatalf("%d GPUs visible; the GPU tests need two (KVH_CUDA_PEER=0 runs them within one)", n)
	}
	g0, err := Open(0)
	if err != nil {
		t.Fatal(err)
	}
	defer g0.Close()
	g1 := g0
	if peer != 0 {
		if g1, err = Open(peer); err != nil {
			t.Fatal(err)
		}
		defer g1.Close()
		if ok, err := g1.CanAccessPeer(0); err != nil || !ok {
			t.Fatalf("GPU %d cannot reach GPU 0's memory (%v): no peer path", peer, err)
		}
	}
	src, err := g0.Alloc(copySize)
	if err != nil {
		t.Fatal(err)
	}
	defer g0.Free(src)
	if err := g0.Upload(src, pattern(copySize, 0x5a)); err != nil {
		t.Fatal(err)
	}
	h, err := g0.Export(src)
	if err != nil {
		t.Fatal(err)
	}

	// The raw ceiling: the same bytes, GPU 0 to the peer, within this process.
	if peer != 0 {
		if err := g1.EnablePeer(g0); err != nil {
			t.Fatal(err)
		}
	}
	dst, err := g1.Alloc(copySize)
	if err != nil {
		t.Fatal(err)
	}
	defer g1.Free(dst)
	s, err := g1.NewStream()
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	rate := func(n int) float64 { // best of rounds: the bytes in n copies, then a sync
		best := time.Duration(1 << 62)
		for range rounds {
			start := time.Now()
			for i := range uint64(n) {
				off := Ptr(i * copySize / uint64(n))
				if err := s.Copy(dst+off, src+off, copySize/uint64(n)); err != nil {
					t.Fatal(err)
				}
			}
			if err := s.Sync(); err != nil {
				t.Fatal(err)
			}
			best = min(best, time.Since(start))
		}
		return copySize / best.Seconds() / 1e9
	}
	rawOne, raw := rate(1), rate(pieces)

	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), "KVH_CUDA_CHILD=1", "KVH_CUDA_GPU="+strconv.Itoa(peer), "KVH_CUDA_HANDLE="+hex.EncodeToString(h[:]))
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("child: %v\n%s", err, out)
	}
	var res childResult
	if err := json.Unmarshal(out, &res); err != nil {
		t.Fatalf("child said %q: %v", out, err)
	}
	if res.Err != "" {
		t.Fatal("child: " + res.Err)
	}
	if !res.Verified {
		t.Fatal("the bytes copied through the IPC handle differ from the source")
	}
	t.Logf("GPU 0 → GPU %d, %d MiB in %d copies: within one process %.1f GB/s (as one copy %.1f); through a CUDA IPC handle in another process "+
		"%.1f GB/s (%.2f×)",
		peer, copySize>>20, pieces, raw, rawOne, res.GBps, res.GBps/raw)
	if dir := os.Getenv("KVH_GPU_OUT"); dir != "" {
		b, _ := json.MarshalIndent(map[string]any{
			"source_gpu": 0, "destination_gpu": peer, "bytes": copySize, "pieces": pieces, "rounds_best_of": rounds,
			"raw_copy_gb_per_s": raw, "raw_one_copy_gb_per_s": rawOne, "ipc_copy_other_process_gb_per_s": res.GBps, "ipc_over_raw": res.GBps / raw,
		}, "", "  ")
		if err := os.WriteFile(filepath.Join(dir, "ipc-copy.json"), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
}
