package simengine

import (
	"strings"
	"testing"
)

func TestQwen3_32BSizesMatchTheDesign(t *testing.T) {
	l := Qwen3_32B(8, 1)
	if l.BytesPerToken() != 256<<10 {
		t.Errorf("%d bytes per token, want 256 KiB", l.BytesPerToken())
	}
	if l.BlockBytes() != 4096 {
		t.Errorf("%d-byte blocks at TP8, want 4 KiB", l.BlockBytes())
	}
	// A 16k-token request: 1024 blocks × 128 regions = 131072 descriptors per rank unmerged.
	if got := 16384 / l.BlockSize * l.Regions(); got != 131072 {
		t.Errorf("%d descriptors per rank, want 131072", got)
	}
	if err := (Layout{Layers: 1, BlockSize: 16, KVHeads: 8, HeadDim: 128, DTypeBytes: 2, TP: 3, Blocks: 1}).Validate(); err == nil {
		t.Error("8 KV heads over TP 3 validated")
	}
}

func cache(t *testing.T, l Layout) *Cache {
	regions := make([][]byte, l.Regions())
	for i := range regions {
		regions[i] = make([]byte, l.Blocks*l.BlockBytes())
	}
	c, err := NewCache(l, regions)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func TestVerifyFindsEveryKindOfWrongByte(t *testing.T) {
	l := Layout{Layers: 2, BlockSize: 4, KVHeads: 2, HeadDim: 8, DTypeBytes: 2, TP: 1, Blocks: 16}
	prefill, decode := cache(t, l), cache(t, l)
	src, dst := []uint32{3, 4, 9}, []uint32{0, 7, 8}
	prefill.Fill("req-a", src)
	if err := prefill.Verify("req-a", src); err != nil {
		t.Fatal(err)
	}
	// The handoff: copy block by block, as the fabric would.
	bb := l.BlockBytes()
	for r := range prefill.Regions {
		for i := range src {
			copy(decode.Regions[r][int(dst[i])*bb:], prefill.Regions[r][int(src[i])*bb:(int(src[i])+1)*bb])
		}
	}
	if err := decode.Verify("req-a", dst); err != nil {
		t.Fatal(err)
	}
	for name, check := range map[string]func() error{
		"another request's KV":    func() error { return decode.Verify("req-b", dst) },
		"blocks in another order": func() error { return decode.Verify("req-a", []uint32{7, 0, 8}) },
		"a block never written":   func() error { return decode.Verify("req-a", []uint32{0, 7, 9}) },
		"one flipped byte": func() error {
			decode.Regions[3][int(dst[2])*bb+5] ^= 1
			return decode.Verify("req-a", dst)
		},
		"one flipped byte past the tag": func() error {
			decode.Regions[1][int(dst[0])*bb+bb-1] ^= 1
			return decode.Verify("req-a", dst[:1])
		},
	} {
		if err := check(); err == nil || !strings.Contains(err.Error(), "want") {
			t.Errorf("%s: %v", name, err)
		}
	}
}

func TestFreedBlocksComeBackInAscendingRuns(t *testing.T) {
	e := &Engine{cfg: Config{Layout: Layout{Blocks: 8}}, freed: make(chan struct{})}
	for b := 7; b >= 0; b-- {
		e.free = append(e.free, uint32(b))
	}
	first, _ := e.Allocate(4)
	e.Free(first)
	again, _ := e.Allocate(4)
	for i := range again {
		if again[i] != first[i] || (i > 0 && again[i] != again[i-1]+1) {
			t.Fatalf("allocated %v after freeing %v: runs must stay ascending for merging", again, first)
		}
	}
}

// BenchmarkFillAndVerify is the simulated engines' own CPU work per byte of KV: the
// benchmark's requests are filled on prefill and checked on decode at this speed.
func BenchmarkFillAndVerify(b *testing.B) {
	l := Qwen3_32B(8, 256)
	c := cache(&testing.T{}, l)
	blocks := make([]uint32, l.Blocks)
	for i := range blocks {
		blocks[i] = uint32(i)
	}
	b.SetBytes(int64(l.Blocks * l.BlockBytes() * l.Regions()))
	for b.Loop() {
		c.Fill("req", blocks)
		if err := c.Verify("req", blocks); err != nil {
			b.Fatal(err)
		}
	}
}
