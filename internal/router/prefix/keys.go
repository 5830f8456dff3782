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
	"encoding/json"

	"github.com/cespare/xxhash/v2"

	"github.com/kvhandoff/kvhandoff/internal/router/protocol"
)

// Key names a block and, through the chain, every block before it.
type Key uint64

// bytesPerToken is the router's estimate of a text prompt's bytes per token
// (protocol.PromptTokens counts text that way).
const bytesPerToken = 4

// idBytes is a token id's size in a block's hashed bytes: 4, little-endian.
const idBytes = 4

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
// starts from the request's model and cache_salt (Root): vLLM keys a LoRA adapter's and a
// salted request's blocks apart, and so does this. A prompt form with no prefix to
// speak of (a batch of prompts, none at all) has no keys.
func Cut(b protocol.Body, blockTokens int) Prompt {
	if blockTokens <= 0 {
		return Prompt{}
	}
	parent := Root(jsonString(b["model"]), jsonString(b["cache_salt"]))
	if raw := bytes.TrimSpace(b["prompt"]); len(raw) > 0 {
		if ids, ok := tokenIDs(raw); ok {
			return Prompt{Keys: Chain(parent, ids, blockTokens), Tokens: len(ids) / idBytes, Exact: true}
		}
		if raw[0] == '"' {
			return text(parent, raw, blockTokens)
		}
		return Prompt{Tokens: protocol.PromptTokens(b)}
	}
	if raw := bytes.TrimSpace(b["messages"]); len(raw) > 0 && raw[0] == '[' {
		// The messages array as sent, without its closing bracket: a conversation's next
		// turn appends to it.
		return text(parent, raw[:len(raw)-1], blockTokens)
	}
	return Prompt{}
}

// Root is the key a prompt's chain starts from: its model (a LoRA adapter's name, for
// the adapter's blocks) and its cache_salt ("" for none).
func Root(model, salt string) Key {
	h := xxhash.New()
	h.WriteString(model)
	h.Write([]byte{0})
	h.WriteString(salt)
	return Key(h.Sum64())
}

// Chain keys the whole blocks of blockTokens token ids after parent; ids are idBytes
// little-endian bytes each, as the index keys token-id prompts (vLLM's KV events chain
// their blocks with it: package kvevents).
func Chain(parent Key, ids []byte, blockTokens int) []Key {
	return chain(parent, ids, blockTokens*idBytes)
}

// AppendID appends a token id to ids as Chain reads it.
func AppendID(ids []byte, id uint32) []byte { return binary.LittleEndian.AppendUint32(ids, id) }

// jsonString is a JSON string's value (a model name, a salt: short), or raw as it is
// when it is not a string.
func jsonString(raw []byte) string {
	raw = bytes.TrimSpace(raw)
	if len(raw) < 2 || raw[0] != '"' || raw[len(raw)-1] != '"' {
		return string(raw)
	}
	if bytes.IndexByte(raw, '\\') < 0 {
		return string(raw[1 : len(raw)-1])
	}
	var s string
	if json.Unmarshal(raw, &s) != nil {
		return string(raw)
	}
	return s
}

func text(parent Key, raw []byte, blockTokens int) Prompt {
	return Prompt{Keys: chain(parent, raw, blockTokens*bytesPerToken), Tokens: (len(raw) + bytesPerToken - 1) / bytesPerToken}
}

// chain keys the whole blocks of size bytes in raw: each key hashes its parent's key and
// the block's bytes (xxHash64: a 16k-token prompt is 1,024 blocks hashed on every
// request, and a key means the same in every process).
func chain(parent Key, raw []byte, size int) []Key {
	keys := make([]Key, len(raw)/size)
	h := xxhash.New()
	var buf [8]byte
	for i := range keys {
		h.Reset()
		binary.LittleEndian.PutUint64(buf[:], uint64(parent))
		h.Write(buf[:])
		h.Write(raw[i*size : (i+1)*size])
		parent = Key(h.Sum64())
		keys[i] = parent
	}
	return keys
}

// tokenIDs reads a flat JSON array of token ids into idBytes little-endian bytes each; ok is
// false for anything else. One pass, not encoding/json: a 16k-token prompt is 100 KB of
// ids, read on every request.
func tokenIDs(raw []byte) ([]byte, bool) {
	if len(raw) < 2 || raw[0] != '[' || raw[len(raw)-1] != ']' {
		return nil, false
	}
	ids := make([]byte, 0, idBytes*(bytes.Count(raw, []byte{','})+1))
	const (
		before = iota // a value comes next (or, first, the end)
		in            // in a value's digits
		after         // a value ended: a comma or the end comes next
	)
	state, v, digits := before, uint64(0), 0
	for _, c := range raw[1 : len(raw)-1] {
		switch {
		case c-'0' <= 9:
			if state == after || digits == 10 {
				return nil, false
			}
			state, v, digits = in, v*10+uint64(c-'0'), digits+1
		case c == ',':
			if state == before || v >= 1<<32 {
				return nil, false
			}
			ids = AppendID(ids, uint32(v))
			state, v, digits = before, 0, 0
		case c == ' ' || c == '\t' || c == '\n' || c == '\r':
			if state == in {
				state = after
			}
		default:
			return nil, false
		}
	}
	switch {
	case state != before:
		if v >= 1<<32 {
			return nil, false
		}
		ids = AppendID(ids, uint32(v))
	case len(ids) > 0:
		return nil, false // a trailing comma
	}
	return ids, true
}
