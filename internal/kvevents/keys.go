package kvevents

import (
	"github.com/kvhandoff/kvhandoff/internal/router/prefix"
)

// Keys follows one engine's events and names its blocks as the router names a token-id
// prompt's (package prefix): a prompt's first block chains from its model's and salt's
// Root, every later one from its parent's key. A block the router could not key — one
// hashed with a multimodal input or prompt embeddings, one whose parent was never seen
// (stored before the sidecar listened, or lost in a gap), one of an offloading tier or of
// a group that is not full attention — is left out, and so is everything chained after
// it: the index then holds less than the engine, never more.
type Keys struct {
	// Model is the engine's served model name: the root of its base model's chains
	// (an adapter's chains start from the adapter's name, as a request names it).
	Model string
	// MaxBlocks bounds the blocks held; a store beyond it is left out (counted).
	MaxBlocks int

	blocks map[string]prefix.Key // vLLM's block hash → key
	group  int                   // the KV cache group followed; -1 until the first store
}

// Change is what an event changed of the keys an engine holds.
type Change struct {
	Added, Removed []prefix.Key
	// Cleared: the engine dropped every block (AllBlocksCleared).
	Cleared bool
	// Skipped counts stored blocks left out, by reason.
	Skipped map[string]int
}

// Reasons a stored block is left out.
const (
	SkipUnkeyed   = "unkeyed"    // hashed with more than tokens, LoRA and salt
	SkipNoParent  = "no_parent"  // its parent is not held
	SkipOtherTier = "other_tier" // another medium or KV cache group
	SkipMalformed = "malformed"  // token ids do not fill its blocks
	SkipFull      = "full"       // MaxBlocks held
)

// NewKeys returns the keys of an engine serving model, holding nothing.
func NewKeys(model string, maxBlocks int) *Keys {
	return &Keys{Model: model, MaxBlocks: maxBlocks, blocks: map[string]prefix.Key{}, group: -1}
}

// Len is how many blocks are held.
func (k *Keys) Len() int { return len(k.blocks) }

// All is every key held, in no order.
func (k *Keys) All() []prefix.Key {
	all := make([]prefix.Key, 0, len(k.blocks))
	for _, key := range k.blocks {
		all = append(all, key)
	}
	return all
}

// Reset forgets every block (the stream from vLLM was interrupted: what it held is no
// longer known).
func (k *Keys) Reset() { clear(k.blocks) }

// Apply folds an event into the keys and says what changed.
func (k *Keys) Apply(e Event) Change {
	var c Change
	switch e.Kind {
	case KindCleared:
		k.Reset()
		c.Cleared = true
	case KindRemoved:
		if !k.followed(e, false) {
			return c
		}
		for _, h := range e.Hashes {
			if key, ok := k.blocks[h]; ok {
				delete(k.blocks, h)
				c.Removed = append(c.Removed, key)
			}
		}
	case KindStored:
		c.Added, c.Skipped = k.store(e)
	}
	return c
}

// followed reports whether e is of the medium and KV cache group followed: the GPU's,
// and the first full-attention group stored (a hybrid model's sliding-window groups
// hold no prefix a request can reuse whole).
func (k *Keys) followed(e Event, store bool) bool {
	if e.Medium != "" && e.Medium != mediumGPU {
		return false
	}
	if store && k.group < 0 && (e.SpecKind == "" || e.SpecKind == fullAttnKind) {
		k.group = e.Group
	}
	return e.Group == k.group
}

func (k *Keys) store(e Event) ([]prefix.Key, map[string]int) {
	skip := func(reason string) ([]prefix.Key, map[string]int) {
		return nil, map[string]int{reason: len(e.Hashes)}
	}
	if !k.followed(e, true) {
		return skip(SkipOtherTier)
	}
	if e.BlockSize <= 0 || len(e.TokenIDs) != e.BlockSize*len(e.Hashes) || (e.ExtraKeys != nil && len(e.ExtraKeys) != len(e.Hashes)) {
		return skip(SkipMalformed)
	}
	model := k.Model
	if e.LoRA != "" {
		model = e.LoRA
	}
	var parent prefix.Key
	if e.Parent != "" {
		p, ok := k.blocks[e.Parent]
		if !ok {
			return skip(SkipNoParent)
		}
		parent = p
	} else {
		salt, ok := saltOf(first(e.ExtraKeys), e.LoRA, true)
		if !ok {
			return skip(SkipUnkeyed)
		}
		parent = prefix.Root(model, salt)
	}
	ids := make([]byte, 0, len(e.TokenIDs)*4)
	for _, id := range e.TokenIDs {
		ids = prefix.AppendID(ids, id)
	}
	// Every block keyed in one pass; those from the first left out on are dropped.
	keys := prefix.Chain(parent, ids, e.BlockSize)
	for i, h := range e.Hashes {
		if i > 0 && e.ExtraKeys != nil {
			if _, ok := saltOf(e.ExtraKeys[i], e.LoRA, false); !ok {
				return keys[:i], map[string]int{SkipUnkeyed: len(e.Hashes) - i}
			}
		}
		if _, held := k.blocks[h]; !held && len(k.blocks) >= k.MaxBlocks {
			return keys[:i], map[string]int{SkipFull: len(e.Hashes) - i}
		}
		k.blocks[h] = keys[i]
	}
	return keys, nil
}

// first is a store's first block's extra keys (none when the store has none).
func first(extra [][]any) []any {
	if len(extra) == 0 {
		return nil
	}
	return extra[0]
}

// saltOf reads a block's extra keys, in vLLM's order: the LoRA name (when the blocks are
// an adapter's), then multimodal pairs, the cache_salt (a prompt's first block only) and
// prompt-embedding digests. ok is false when anything but the name and the salt is there:
// the router keys tokens alone.
func saltOf(extra []any, lora string, first bool) (salt string, ok bool) {
	if lora != "" && len(extra) > 0 && extra[0] == lora {
		extra = extra[1:]
	}
	switch {
	case len(extra) == 0:
		return "", true
	case len(extra) == 1 && first:
		salt, ok = extra[0].(string)
		return salt, ok
	}
	return "", false
}
