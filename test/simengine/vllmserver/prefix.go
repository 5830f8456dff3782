package vllmserver

import (
	"container/list"
	"hash/fnv"
	"sync"
)

// prefixCache is a simulated engine's prefix cache, as vLLM's: whole blocks of prompt
// tokens, each known by a hash chained from the block before it, kept least recently used
// first out within the engine's capacity. It holds no memory, only which blocks the
// engine could reuse, which is all the timing and the transfer sizes depend on.
type prefixCache struct {
	block, capacity int

	mu            sync.Mutex
	lru           *list.List // of uint64, most recent first
	at            map[uint64]*list.Element
	queries, hits int64 // tokens, as vllm:prefix_cache_queries/hits count them
}

func newPrefixCache(blocks, blockTokens int) *prefixCache {
	if blocks <= 0 {
		return nil
	}
	return &prefixCache{block: blockTokens, capacity: blocks, lru: list.New(), at: map[uint64]*list.Element{}}
}

// keys names the prompt's whole blocks.
func (c *prefixCache) keys(prompt []string) []uint64 {
	if c == nil {
		return nil
	}
	keys := make([]uint64, len(prompt)/c.block)
	parent := uint64(0)
	for i := range keys {
		h := fnv.New64a()
		var b [8]byte
		for j := range b {
			b[j] = byte(parent >> (8 * j))
		}
		h.Write(b[:])
		for _, tok := range prompt[i*c.block : (i+1)*c.block] {
			h.Write([]byte(tok))
			h.Write([]byte{0})
		}
		parent = h.Sum64()
		keys[i] = parent
	}
	return keys
}

// lookup is how many of a prompt of tokens (its block keys) the engine holds, in tokens:
// its leading blocks held, all but the last block of a prompt held whole (vLLM computes
// at least a prompt's last token).
func (c *prefixCache) lookup(keys []uint64, tokens int) int {
	if c == nil {
		return 0
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	n := 0
	for _, k := range keys {
		e, ok := c.at[k]
		if !ok {
			break
		}
		c.lru.MoveToFront(e)
		n++
	}
	if n*c.block >= tokens {
		n = (tokens - 1) / c.block
	}
	c.queries += int64(tokens)
	c.hits += int64(n * c.block)
	return n * c.block
}

// add records that the engine holds keys' blocks (it computed or received them).
func (c *prefixCache) add(keys []uint64) {
	if c == nil {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	for i := len(keys) - 1; i >= 0; i-- { // the leaf least recent: evicted first
		if e, ok := c.at[keys[i]]; ok {
			c.lru.MoveToFront(e)
			continue
		}
		if c.lru.Len() >= c.capacity {
			delete(c.at, c.lru.Remove(c.lru.Back()).(uint64))
		}
		c.at[keys[i]] = c.lru.PushFront(keys[i])
	}
}

func (c *prefixCache) counts() (queries, hits int64) {
	if c == nil {
		return 0, 0
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.queries, c.hits
}
