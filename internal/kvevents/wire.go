// Package kvevents is the kv-events sidecar of an engine pod (cmd/kv-events): it turns
// vLLM's KV cache events into the keys of the blocks the engine holds, as the engine itself
// reports them, rather than as the routers remember sending them.
//
// vLLM publishes its events (--kv-events-config) over ZeroMQ to the sidecar's listener on
// the pod's own loopback (subscribe.go); the events carry every prompt's token ids and
// never leave the pod. The sidecar decodes them (wire.go), keys each stored block as the
// router keys a token-id prompt (keys.go, package prefix) and serves only those keys to
// the routers and endpoint pickers that present the pool's token (server.go, auth.go), in
// package keystream's frames; they fold them into the index they choose engines with
// (package router/kvfollow).
package kvevents

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"

	"github.com/vmihailenco/msgpack/v5"
	"github.com/vmihailenco/msgpack/v5/msgpcode"
)

// The kinds of event vLLM publishes (msgspec tags them "type" with the class name).
const (
	KindStored   = "BlockStored"
	KindRemoved  = "BlockRemoved"
	KindCleared  = "AllBlocksCleared"
	mediumGPU    = "GPU"
	fullAttnKind = "full_attention"
)

// Event is one of vLLM's KV cache events (vllm/distributed/kv_events.py), the fields this
// package reads.
type Event struct {
	Kind string
	// Hashes are the blocks' hashes, each as a string of its bytes (vLLM's
	// ExternalBlockHash is an int or bytes, by release and hash function).
	Hashes []string
	// Parent is the hash of the block before the first of Hashes; "" for a prompt's
	// first block.
	Parent string
	// TokenIDs are the stored blocks' tokens, BlockSize a block.
	TokenIDs  []uint32
	BlockSize int
	// LoRA is the adapter's name whose blocks these are; "" for the base model.
	LoRA string
	// Medium is where the blocks are: "GPU" ("" for releases that do not say), or an
	// offloading tier's.
	Medium string
	// ExtraKeys are, per block, what vLLM hashed besides the tokens (untagged): the LoRA
	// name, multimodal (identifier, offset) pairs, the cache_salt, prompt-embedding digests.
	ExtraKeys [][]any
	// Group is the KV cache group (hybrid models have several); SpecKind its kind.
	Group    int
	SpecKind string
}

// Batch is one message of vLLM's publisher.
type Batch struct {
	Seq    uint64
	Events []Event
}

// maxMessage bounds a message: a batch of a 128k-token prompt's stores is about 700 KB,
// and a step's batch holds at most its batched tokens' stores.
const maxMessage = 16 << 20

// DecodeMessage reads a publisher message's frames: topic, 8-byte big-endian sequence
// number, msgpack batch.
func DecodeMessage(frames [][]byte) (Batch, error) {
	if len(frames) != 3 {
		return Batch{}, fmt.Errorf("a message of %d frames: vLLM sends 3 (topic, sequence, payload)", len(frames))
	}
	if len(frames[1]) != 8 {
		return Batch{}, fmt.Errorf("a sequence frame of %d bytes: must be 8", len(frames[1]))
	}
	if len(frames[2]) > maxMessage {
		return Batch{}, fmt.Errorf("a payload of %d bytes: at most %d", len(frames[2]), maxMessage)
	}
	if err := checkDepth(frames[2]); err != nil {
		return Batch{}, err
	}
	events, err := decodeBatch(frames[2])
	if err != nil {
		return Batch{}, err
	}
	return Batch{Seq: binary.BigEndian.Uint64(frames[1]), Events: events}, nil
}

// decodeBatch reads an EventBatch: vLLM encodes it as an array [ts, events,
// data_parallel_rank] (msgspec array_like, through 0.34), later releases as a map.
func decodeBatch(payload []byte) ([]Event, error) {
	d := msgpack.NewDecoder(bytes.NewReader(payload))
	c, err := d.PeekCode()
	if err != nil {
		return nil, fmt.Errorf("batch: %w", err)
	}
	if msgpcode.IsFixedMap(c) || c == msgpcode.Map16 || c == msgpcode.Map32 {
		n, err := d.DecodeMapLen()
		if err != nil {
			return nil, fmt.Errorf("batch: %w", err)
		}
		var events []Event
		for range n {
			k, err := d.DecodeString()
			if err != nil {
				return nil, fmt.Errorf("batch: %w", err)
			}
			if k != "events" {
				if err := d.Skip(); err != nil {
					return nil, fmt.Errorf("batch.%s: %w", k, err)
				}
				continue
			}
			if events, err = decodeEvents(d); err != nil {
				return nil, err
			}
		}
		return events, nil
	}
	n, err := d.DecodeArrayLen()
	if err != nil {
		return nil, fmt.Errorf("batch: neither an array nor a map: %w", err)
	}
	if n < 2 {
		return nil, fmt.Errorf("batch: an array of %d: must hold ts and events", n)
	}
	if err := d.Skip(); err != nil { // ts
		return nil, fmt.Errorf("batch.ts: %w", err)
	}
	return decodeEvents(d)
}

func decodeEvents(d *msgpack.Decoder) ([]Event, error) {
	n, err := d.DecodeArrayLen()
	if err != nil {
		return nil, fmt.Errorf("batch.events: %w", err)
	}
	events := make([]Event, 0, min(max(n, 0), 1024))
	for i := range n {
		e, err := decodeEvent(d)
		if err != nil {
			return nil, fmt.Errorf("batch.events[%d]: %w", i, err)
		}
		events = append(events, e)
	}
	return events, nil
}

func decodeEvent(d *msgpack.Decoder) (Event, error) {
	n, err := d.DecodeMapLen()
	if err != nil {
		return Event{}, fmt.Errorf("not a map: %w", err)
	}
	var e Event
	for range n {
		k, err := d.DecodeString()
		if err != nil {
			return Event{}, err
		}
		switch k {
		case "type":
			e.Kind, err = d.DecodeString()
		case "block_hashes":
			var hs []any
			if hs, err = d.DecodeSlice(); err == nil {
				e.Hashes = make([]string, len(hs))
				for i, h := range hs {
					if e.Hashes[i], err = hashString(h); err != nil {
						break
					}
				}
			}
		case "parent_block_hash":
			var h any
			if h, err = d.DecodeInterface(); err == nil && h != nil {
				e.Parent, err = hashString(h)
			}
		case "token_ids":
			e.TokenIDs, err = decodeTokenIDs(d)
		case "block_size":
			e.BlockSize, err = d.DecodeInt()
		case "lora_name":
			e.LoRA, err = optionalString(d)
		case "medium":
			e.Medium, err = optionalString(d)
		case "extra_keys":
			var keys []any
			if keys, err = d.DecodeSlice(); err == nil && keys != nil {
				e.ExtraKeys = make([][]any, len(keys))
				for i, k := range keys {
					if k == nil {
						continue
					}
					if e.ExtraKeys[i], _ = k.([]any); e.ExtraKeys[i] == nil {
						err = fmt.Errorf("extra_keys[%d] is %T: must be an array or nil", i, k)
						break
					}
				}
			}
		case "group_idx":
			var g any
			if g, err = d.DecodeInterface(); err == nil && g != nil {
				v, ok := unsigned(g)
				if !ok || v > 1<<16 {
					err = fmt.Errorf("group_idx is %v: must be a small count", g)
				}
				e.Group = int(v)
			}
		case "kv_cache_spec_kind":
			e.SpecKind, err = optionalString(d)
		default:
			err = d.Skip()
		}
		if err != nil {
			return Event{}, fmt.Errorf("%s: %w", k, err)
		}
	}
	if e.Kind == "" {
		return Event{}, errors.New("no type")
	}
	return e, nil
}

// decodeTokenIDs reads an array of token ids as they are, not as values in interfaces: a
// 16k-token prompt's store holds 16k of them.
func decodeTokenIDs(d *msgpack.Decoder) ([]uint32, error) {
	n, err := d.DecodeArrayLen()
	if err != nil || n < 0 {
		return nil, err
	}
	ids := make([]uint32, 0, min(n, 1<<16)) // a claimed length is not trusted
	for i := range n {
		c, err := d.PeekCode()
		if err != nil {
			return nil, err
		}
		if msgpcode.IsFixedNum(c) && int8(c) < 0 || c == msgpcode.Int8 || c == msgpcode.Int16 || c == msgpcode.Int32 || c == msgpcode.Int64 {
			v, err := d.DecodeInt64()
			if err != nil || v < 0 || v >= 1<<32 {
				return nil, fmt.Errorf("token_ids[%d] is %d: must be a token id", i, v)
			}
			ids = append(ids, uint32(v))
			continue
		}
		v, err := d.DecodeUint64()
		if err != nil || v >= 1<<32 {
			return nil, fmt.Errorf("token_ids[%d]: must be a token id (%v)", i, err)
		}
		ids = append(ids, uint32(v))
	}
	return ids, nil
}

func optionalString(d *msgpack.Decoder) (string, error) {
	v, err := d.DecodeInterface()
	if err != nil || v == nil {
		return "", err
	}
	s, ok := v.(string)
	if !ok {
		return "", fmt.Errorf("%T: must be a string", v)
	}
	return s, nil
}

// hashString is a block hash as a map key: an int as its 8 bytes, bytes as they are
// (a 'b' first, so that 8 bytes of a hash never equal an int's).
func hashString(h any) (string, error) {
	if b, ok := h.([]byte); ok {
		return "b" + string(b), nil
	}
	if v, ok := unsigned(h); ok {
		return string(binary.BigEndian.AppendUint64(nil, v)), nil
	}
	if v, ok := h.(int64); ok { // a negative int: its two's complement bits
		return string(binary.BigEndian.AppendUint64(nil, uint64(v))), nil
	}
	return "", fmt.Errorf("a block hash of %T: must be an int or bytes", h)
}

// unsigned is a msgpack integer that is not negative.
func unsigned(v any) (uint64, bool) {
	switch n := v.(type) {
	case uint8:
		return uint64(n), true
	case uint16:
		return uint64(n), true
	case uint32:
		return uint64(n), true
	case uint64:
		return n, true
	case int8:
		return uint64(n), n >= 0
	case int16:
		return uint64(n), n >= 0
	case int32:
		return uint64(n), n >= 0
	case int64:
		return uint64(n), n >= 0
	}
	return 0, false
}
