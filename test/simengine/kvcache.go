// Package simengine is the simulated vLLM engine that tests and the handoff benchmark use
// to drive transfer agents. This file is its KV cache: host memory in vLLM's layout, filled
// with a pattern derived from the request and token position, so the decode side can
// verify every byte it received.
package simengine

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"hash/fnv"

	agentv1 "github.com/kvhandoff/kvhandoff/transferagent/api/v1"
)

// Layout is a model's KV cache on one tensor-parallel rank.
type Layout struct {
	Layers     int
	BlockSize  int // tokens per block (vLLM --block-size)
	KVHeads    int // KV heads of the whole model
	HeadDim    int
	DTypeBytes int // 2 for bf16
	TP         int // tensor-parallel size: a rank holds KVHeads/TP heads (one, replicated, when TP > KVHeads)
	Rank       int // the rank whose heads this is (Start sets it from Config.Rank)
	Blocks     int // blocks per region
}

// Qwen3_32B is the model docs/design.md#sizes sizes everything by: 64 layers × 8 KV heads × 128 ×
// K,V × bf16 = 256 KiB per token; at TP8 a block of one layer's K or V on one rank is 4 KiB.
func Qwen3_32B(tp, blocks int) Layout {
	return Layout{Layers: 64, BlockSize: 16, KVHeads: 8, HeadDim: 128, DTypeBytes: 2, TP: tp, Blocks: blocks}
}

// Regions is the number of KV regions on a rank: one per layer for K and one for V.
func (l Layout) Regions() int { return 2 * l.Layers }

// BlockBytes is one block of one region on one rank: its heads one after another (HND),
// each HeadBytes.
func (l Layout) BlockBytes() int { return int(l.Heads().Count) * l.HeadBytes() }

// HeadBytes is one KV head's share of a block.
func (l Layout) HeadBytes() int { return l.BlockSize * l.HeadDim * l.DTypeBytes }

// Heads is the model's KV heads the rank holds.
func (l Layout) Heads() agentv1.Heads {
	return agentv1.RankHeads(uint32(l.KVHeads), uint32(l.TP), uint32(l.Rank))
}

// BytesPerToken is the KV one token takes across all ranks.
func (l Layout) BytesPerToken() int { return l.Regions() * l.KVHeads * l.HeadDim * l.DTypeBytes }

// Validate reports a layout that cannot be laid out.
func (l Layout) Validate() error {
	if l.Layers <= 0 || l.BlockSize <= 0 || l.HeadDim <= 0 || l.DTypeBytes <= 0 || l.Blocks <= 0 || l.TP <= 0 {
		return fmt.Errorf("simengine: layout %+v has a non-positive field", l)
	}
	if err := agentv1.CheckShards(uint32(l.KVHeads), uint32(l.TP)); err != nil {
		return fmt.Errorf("simengine: %w", err)
	}
	if l.Rank < 0 || l.Rank >= l.TP {
		return fmt.Errorf("simengine: rank %d of TP %d", l.Rank, l.TP)
	}
	if l.HeadBytes()%8 != 0 {
		return fmt.Errorf("simengine: %d-byte heads are not a multiple of 8", l.HeadBytes())
	}
	return nil
}

// Cache is a rank's KV cache: one byte slice per region (callers allocate them, off the
// Go heap when they are registered with the fabric). With a device, the regions live in
// GPU memory and the slices are their host mirror: Fill uploads what it wrote, Verify
// checks what it downloads.
type Cache struct {
	Layout  Layout
	Regions [][]byte
	dev     *device
}

// NewCache checks that regions fit the layout.
func NewCache(l Layout, regions [][]byte) (*Cache, error) {
	if err := l.Validate(); err != nil {
		return nil, err
	}
	if len(regions) != l.Regions() {
		return nil, fmt.Errorf("simengine: %d regions for a layout of %d", len(regions), l.Regions())
	}
	for i, r := range regions {
		if len(r) != l.Blocks*l.BlockBytes() {
			return nil, fmt.Errorf("simengine: region %d is %d bytes, want %d", i, len(r), l.Blocks*l.BlockBytes())
		}
	}
	return &Cache{Layout: l, Regions: regions}, nil
}

// blockBase is the tag, the first word, of KV head h's slice of the block holding
// token-order block position pos of a request, in region r: an xorshift of a seed unique
// to all four, so a slice written to the wrong place, head, region or request does not
// verify. The tag depends on the model's head, not the rank's: ranks of any
// tensor-parallel size agree on it.
func blockBase(seed uint64, r, pos, h int) uint64 {
	x := seed ^ uint64(r)<<48 ^ uint64(pos)<<24 ^ uint64(h)<<4
	x ^= x << 13
	x ^= x >> 7
	x ^= x << 17
	return x*0x9E3779B97F4A7C15 + 1
}

// step advances the body's pattern word by word (an odd constant: every word of a block
// differs, so a shifted or partial write does not verify).
const step = 0xD1B54A32D192ED03

// body is the rest of every head slice of a request: words that start from the request's
// seed and advance by step. A slice is its tag and then the body, so filling is one copy
// and verifying one compare per slice — memory speed. The benchmark fills and verifies
// gigabytes on the same cores that move them, and the check must not crowd out what it
// measures.
func (c *Cache) body(seed uint64) []byte {
	b := make([]byte, c.Layout.HeadBytes())
	v := seed*0x9E3779B97F4A7C15 | 1
	for w := 8; w+8 <= len(b); w += 8 {
		binary.LittleEndian.PutUint64(b[w:], v)
		v += step
	}
	return b
}

func requestSeed(request string) uint64 {
	h := fnv.New64a()
	h.Write([]byte(request))
	return h.Sum64()
}

// Fill writes request's pattern into blocks, which hold token-order positions 0, 1, …
// of the request — what a prefill engine produces.
func (c *Cache) Fill(request string, blocks []uint32) {
	c.dev.lock()
	defer c.dev.unlock()
	seed := requestSeed(request)
	body := c.body(seed)
	bb, hb, heads := c.Layout.BlockBytes(), c.Layout.HeadBytes(), c.Layout.Heads()
	for r, region := range c.Regions {
		for pos, b := range blocks {
			for k := range int(heads.Count) {
				slice := region[int(b)*bb+k*hb : int(b)*bb+(k+1)*hb]
				copy(slice[8:], body[8:])
				binary.LittleEndian.PutUint64(slice, blockBase(seed, r, pos, int(heads.First)+k))
			}
		}
	}
	if err := c.dev.upload(c, blocks); err != nil {
		panic(fmt.Sprintf("simengine: filling GPU memory: %v", err)) // a test or benchmark cannot go on
	}
}

// Set overwrites blocks of every region with b (tests: a sentinel that must stay).
func (c *Cache) Set(blocks []uint32, b byte) error {
	c.dev.lock()
	defer c.dev.unlock()
	bb := c.Layout.BlockBytes()
	for _, region := range c.Regions {
		for _, blk := range blocks {
			for i := int(blk) * bb; i < (int(blk)+1)*bb; i++ {
				region[i] = b
			}
		}
	}
	return c.dev.upload(c, blocks)
}

// Load brings blocks of every region into Regions (GPU memory: downloads them; host
// memory is there already).
func (c *Cache) Load(blocks []uint32) error {
	c.dev.lock()
	defer c.dev.unlock()
	return c.dev.download(c, blocks, 0, len(c.Regions))
}

// Verify checks that blocks hold request's pattern for positions 0, 1, … — what a decode
// engine checks after the handoff. It names the first wrong byte.
func (c *Cache) Verify(request string, blocks []uint32) error {
	return c.VerifyRegions(request, blocks, 0, len(c.Regions))
}

// VerifyRegions is Verify for regions lo..hi-1 only: one layer group.
func (c *Cache) VerifyRegions(request string, blocks []uint32, lo, hi int) error {
	return c.verify(request, 0, blocks, lo, hi)
}

// VerifyTail is Verify of blocks holding positions first, first+1, …: a push of the tail
// after a prefix the decode engine held.
func (c *Cache) VerifyTail(request string, first int, blocks []uint32) error {
	return c.verify(request, first, blocks, 0, len(c.Regions))
}

func (c *Cache) verify(request string, first int, blocks []uint32, lo, hi int) error {
	c.dev.lock()
	defer c.dev.unlock()
	if err := c.dev.download(c, blocks, lo, hi); err != nil {
		return err
	}
	seed := requestSeed(request)
	body := c.body(seed)
	bb, hb, heads := c.Layout.BlockBytes(), c.Layout.HeadBytes(), c.Layout.Heads()
	for r := lo; r < hi; r++ {
		region := c.Regions[r]
		for i, b := range blocks {
			pos := first + i
			for k := range int(heads.Count) {
				slice := region[int(b)*bb+k*hb : int(b)*bb+(k+1)*hb]
				h := int(heads.First) + k
				binary.LittleEndian.PutUint64(body, blockBase(seed, r, pos, h)) // the tag this slice must carry
				if bytes.Equal(slice, body) {
					continue
				}
				for w := 0; w+8 <= len(slice); w += 8 {
					if got, want := binary.LittleEndian.Uint64(slice[w:]), binary.LittleEndian.Uint64(body[w:]); got != want {
						return fmt.Errorf("simengine: request %s, region %d, block %d (position %d), head %d, byte %d: %#x, want %#x", request, r, b,
							pos, h, k*hb+w, got, want)
					}
				}
			}
		}
	}
	return nil
}
