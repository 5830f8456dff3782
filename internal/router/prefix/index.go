package prefix

import (
	"sort"
	"sync"
)

// Index is, per engine, the blocks it holds: a least-recently-used set of keys whose
// size is bounded by the engine's KV capacity (SetCapacity, from its /metrics) and by
// MaxBlocks, so the router's memory is bounded whatever the prompts (about 40 bytes a
// block: 65,536 blocks, about a million tokens at block size 16, is 2.6 MB an engine).
type Index struct {
	// MaxBlocks bounds every engine's set.
	MaxBlocks int

	mu      sync.Mutex
	engines map[string]*set
}

// DefaultMaxBlocks is the bound of an engine's set where none is given.
const DefaultMaxBlocks = 1 << 16

// NewIndex returns an empty index whose engines hold at most maxBlocks keys each.
func NewIndex(maxBlocks int) *Index {
	if maxBlocks <= 0 {
		maxBlocks = DefaultMaxBlocks
	}
	return &Index{MaxBlocks: maxBlocks, engines: map[string]*set{}}
}

func (ix *Index) engine(id string) *set {
	s := ix.engines[id]
	if s == nil {
		s = newSet(ix.MaxBlocks)
		ix.engines[id] = s
	}
	return s
}

// Match is how many of keys' leading blocks engine holds. It changes nothing: a
// candidate not chosen does not use its blocks (Add renews those of the one chosen).
//
// A set holds a block only with every block before it in its chain (Add renews a chain
// leaf first, so a block is always more recently used than those after it, and the
// least recently used go first), so a binary search finds where a prompt's held blocks
// end: ten lookups for a 16k-token prompt rather than a thousand, on every candidate of
// every request.
func (ix *Index) Match(engine string, keys []Key) int {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	s := ix.engines[engine]
	if s == nil {
		return 0
	}
	return sort.Search(len(keys), func(i int) bool { return !s.has(keys[i]) })
}

// Add records that engine holds keys, a chain from its root (it computed, received or
// reused those blocks), renewing those it held: leaf first, so that eviction takes a
// prompt's last blocks before its first, as vLLM's does.
func (ix *Index) Add(engine string, keys []Key) {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	s := ix.engine(engine)
	for i := len(keys) - 1; i >= 0; i-- {
		s.touch(keys[i])
	}
}

// Remove records that engine no longer holds keys (it evicted them: package kvevents
// relays vLLM's BlockRemoved, a chain's leaf first, so a set still holds a block only
// with every block before it).
func (ix *Index) Remove(engine string, keys []Key) {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	if s := ix.engines[engine]; s != nil {
		for _, k := range keys {
			s.remove(k)
		}
	}
}

// Clear forgets everything engine held (it restarted, or its source was lost).
func (ix *Index) Clear(engine string) {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	delete(ix.engines, engine)
}

// SetCapacity bounds engine's set at blocks (its KV cache's size), within MaxBlocks.
func (ix *Index) SetCapacity(engine string, blocks int) {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	ix.engine(engine).resize(min(max(blocks, 1), ix.MaxBlocks))
}

// Len is how many blocks the index holds for engine.
func (ix *Index) Len(engine string) int {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	if s := ix.engines[engine]; s != nil {
		return len(s.at)
	}
	return 0
}

// Total is how many blocks the index holds, all engines together.
func (ix *Index) Total() int {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	n := 0
	for _, s := range ix.engines {
		n += len(s.at)
	}
	return n
}

// Keep forgets every engine not in alive.
func (ix *Index) Keep(alive map[string]bool) {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	for id := range ix.engines {
		if !alive[id] {
			delete(ix.engines, id)
		}
	}
}

// set is a bounded LRU set of keys: a map to slots of a doubly linked list kept in one
// slice (indexes, not pointers: 16 bytes a slot and nothing for the collector to trace).
type set struct {
	capacity int
	at       map[Key]int32
	slots    []slot
	head     int32 // most recently used; -1 when empty
	tail     int32 // least recently used
	free     int32 // a removed slot to reuse; -1 when none
}

type slot struct {
	key        Key
	prev, next int32
}

func newSet(capacity int) *set {
	return &set{capacity: capacity, at: map[Key]int32{}, head: -1, tail: -1, free: -1}
}

func (s *set) has(k Key) bool { _, ok := s.at[k]; return ok }

// touch makes k the most recently used, adding it (and evicting the least recently used
// beyond capacity).
func (s *set) touch(k Key) {
	if i, ok := s.at[k]; ok {
		s.unlink(i)
		s.pushFront(i)
		return
	}
	if len(s.at) >= s.capacity {
		s.remove(s.slots[s.tail].key)
	}
	var i int32
	if s.free >= 0 {
		i, s.free = s.free, s.slots[s.free].next
	} else {
		s.slots = append(s.slots, slot{})
		i = int32(len(s.slots) - 1)
	}
	s.slots[i].key = k
	s.at[k] = i
	s.pushFront(i)
}

func (s *set) remove(k Key) {
	i, ok := s.at[k]
	if !ok {
		return
	}
	s.unlink(i)
	delete(s.at, k)
	s.slots[i] = slot{next: s.free}
	s.free = i
}

func (s *set) resize(capacity int) {
	s.capacity = capacity
	for len(s.at) > capacity {
		s.remove(s.slots[s.tail].key)
	}
}

func (s *set) unlink(i int32) {
	sl := &s.slots[i]
	if sl.prev >= 0 {
		s.slots[sl.prev].next = sl.next
	} else {
		s.head = sl.next
	}
	if sl.next >= 0 {
		s.slots[sl.next].prev = sl.prev
	} else {
		s.tail = sl.prev
	}
}

func (s *set) pushFront(i int32) {
	s.slots[i].prev, s.slots[i].next = -1, s.head
	if s.head >= 0 {
		s.slots[s.head].prev = i
	}
	s.head = i
	if s.tail < 0 {
		s.tail = i
	}
}
