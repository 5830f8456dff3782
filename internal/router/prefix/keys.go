// Package prefix knows which blocks of a prompt each engine holds in its prefix cache,
// so that the engine-choice unit can send a request to the decode engine that already
// holds most of it, and serve it there alone when what is left to compute is short.
//
// A prompt is cut into blocks, each named by a Key chained from the block before it (a
// block's key names its whole prefix, as vLLM's block hashes do). Token-id prompts are
// cut at the engines' KV block size, exactly where vLLM cuts them: a key stands for one
// of vLLM's cached blocks. Text and chat prompts, which the router cannot tokenize, are
// cut into chunks of blockSize×4 bytes of their JSON (the router's token estimate is
// bytes/4): an approximation whose error is a block at the boundary of what differs.
// The index only steers choices: an engine holding less than it says computes the rest
// itself, correct and slower.
package prefix

import (
	"bytes"
	"encoding/binary"
	"hash/fnv"

	"github.com/kvhandoff/kvhandoff/internal/router/protocol"
)

// Key names a block and, through the chain, every block before it.
type Key uint64

// bytesPerToken is the router's estimate of a text prompt's bytes per token
// (protocol.PromptTokens counts text that way).
const bytesPerToken = 4

// Prompt is a request's prompt cut into blocks: Keys of its whole blocks, each
// BlockTokens tokens (exactly, for token ids; estimated, for text).
type Prompt struct {
	Keys []Key
	// Tokens is the prompt's length in tokens (estimated for text).
	Tokens int
	// Exact is true for token-id prompts: the keys are vLLM's blocks.
	Exact bool
}

// Usable is how many of matched leading blocks an engine can reuse: vLLM computes at
// least a prompt's last token itself, so a prompt that is whole blocks and all cached
// reuses all but its last block.
func (p Prompt) Usable(matched int, blockTokens int) int {
	if p.Exact && matched*blockTokens >= p.Tokens {
		return max((p.Tokens-1)/blockTokens, 0)
	}
	return matched
}

// Cut returns a request body's prompt as keys of blocks of blockTokens tokens. The chain
// starts from the request's model and cache_salt: vLLM keys a LoRA adapter's and a
// salted request's blocks apart, and so does this. A prompt form with no prefix to
// speak of (a batch of prompts, none at all) has no keys.
func Cut(b protocol.Body, blockTokens int) Prompt {
	if blockTokens <= 0 {
		return Prompt{}
	}
	root := fnv.New64a()
	root.Write(b["model"])
	root.Write([]byte{0})
	root.Write(b["cache_salt"])
	seed := Key(root.Sum64())
	if raw := bytes.TrimSpace(b["prompt"]); len(raw) > 0 {
		if ids, ok := tokenIDs(raw); ok {
			return Prompt{Keys: chain(seed, len(ids)/blockTokens, func(i int) []byte { return idBytes(ids[i*blockTokens : (i+1)*blockTokens]) }),
				Tokens: len(ids), Exact: true}
		}
		if raw[0] == '"' {
			return text(seed, raw, blockTokens)
		}
		return Prompt{Tokens: protocol.PromptTokens(b)}
	}
	if raw := bytes.TrimSpace(b["messages"]); len(raw) > 0 && raw[0] == '[' {
		// The messages array as sent, without its closing bracket: a conversation's next
		// turn appends to it.
		return text(seed, raw[:len(raw)-1], blockTokens)
	}
	return Prompt{}
}

func text(seed Key, raw []byte, blockTokens int) Prompt {
	chunk := blockTokens * bytesPerToken
	return Prompt{Keys: chain(seed, len(raw)/chunk, func(i int) []byte { return raw[i*chunk : (i+1)*chunk] }),
		Tokens: (len(raw) + bytesPerToken - 1) / bytesPerToken}
}

// chain keys n blocks: each key hashes its parent's key and the block's bytes.
func chain(parent Key, n int, block func(i int) []byte) []Key {
	keys := make([]Key, n)
	var buf [8]byte
	for i := range keys {
		h := fnv.New64a()
		binary.LittleEndian.PutUint64(buf[:], uint64(parent))
		h.Write(buf[:])
		h.Write(block(i))
		parent = Key(h.Sum64())
		keys[i] = parent
	}
	return keys
}

// TokenKeys chains blocks of token ids from parent (vLLM's KV events name a block's
// tokens and its parent): the keys Cut gives a token-id prompt with the same blocks.
func TokenKeys(parent Key, ids []uint32, blockTokens int) []Key {
	return chain(parent, len(ids)/blockTokens, func(i int) []byte { return idBytes(ids[i*blockTokens : (i+1)*blockTokens]) })
}

func idBytes(ids []uint32) []byte {
	b := make([]byte, 4*len(ids))
	for i, id := range ids {
		binary.LittleEndian.PutUint32(b[4*i:], id)
	}
	return b
}

// tokenIDs reads a flat JSON array of token ids; ok is false for anything else. A scan,
// not encoding/json: a 16k-token prompt is 100 KB of ids, read on every request.
func tokenIDs(raw []byte) ([]uint32, bool) {
	if len(raw) < 2 || raw[0] != '[' || raw[len(raw)-1] != ']' {
		return nil, false
	}
	ids := make([]uint32, 0, bytes.Count(raw, []byte{','})+1)
	inner := raw[1 : len(raw)-1]
	for i := 0; i < len(inner); {
		for i < len(inner) && isSpace(inner[i]) {
			i++
		}
		if i == len(inner) && len(ids) == 0 {
			break // []
		}
		var v uint64
		start := i
		for i < len(inner) && inner[i] >= '0' && inner[i] <= '9' && v <= 1<<32 {
			v = v*10 + uint64(inner[i]-'0')
			i++
		}
		if i == start || v >= 1<<32 {
			return nil, false
		}
		ids = append(ids, uint32(v))
		for i < len(inner) && isSpace(inner[i]) {
			i++
		}
		if i < len(inner) {
			if inner[i] != ',' {
				return nil, false
			}
			i++
			if i == len(inner) {
				return nil, false // a trailing comma
			}
		}
	}
	return ids, true
}

func isSpace(c byte) bool { return c == ' ' || c == '\t' || c == '\n' || c == '\r' }
