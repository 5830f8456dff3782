// Package protocol builds the two legs of a prefill/decode request exactly as vLLM's
// NIXL connectors expect them (vLLM ≥ 0.26: kv_connector/v1/nixl pull and push
// schedulers, and the proxies in examples/disaggregated/disaggregated_serving). Every
// function here is pure: a client's body in, a leg's body out. Fields the router does
// not own are carried as the client sent them, byte for byte.
package protocol

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"slices"
)

// Body is an OpenAI request body, field by field. Values stay raw JSON so that every
// field the router does not own reaches the engine exactly as the client wrote it.
type Body map[string]json.RawMessage

// Parse decodes a request body; it must be one JSON object.
//
// One pass validates the whole body and splits the object's members, without decoding
// their values: a 16k-token prompt of ids is 100 KB of JSON, and decoding it was most of
// a request's cost in the router. Of duplicate keys the last wins, as in encoding/json
// and in vLLM.
func Parse(data []byte) (Body, error) {
	b := Body{}
	var keyErr error
	ok := members(data, func(key, value []byte) {
		var k string
		if err := json.Unmarshal(key, &k); err != nil {
			keyErr = err
		}
		b[k] = value
	})
	if !ok {
		var v any
		err := json.Unmarshal(data, &v) // for the error's position and cause
		return nil, fmt.Errorf("the request body must be one JSON object: %w", err)
	}
	if keyErr != nil {
		return nil, fmt.Errorf("the request body must be one JSON object: %w", keyErr)
	}
	if obj := bytes.TrimSpace(data); obj[0] != '{' {
		return nil, errors.New("the request body must be a JSON object")
	}
	return b, nil
}

// Clone copies the field map (values are immutable raw bytes and are shared).
func (b Body) Clone() Body { return maps.Clone(b) }

// Marshal encodes the body for a leg, keys sorted. Values are written as they are:
// encoding/json would compact them, and passthrough means byte for byte. Every value is
// either the client's, already checked by Parse, or one the router marshalled.
func (b Body) Marshal() []byte {
	keys := slices.Sorted(maps.Keys(b))
	var buf bytes.Buffer
	buf.WriteByte('{')
	for i, k := range keys {
		if i > 0 {
			buf.WriteByte(',')
		}
		name, _ := json.Marshal(k)
		buf.Write(name)
		buf.WriteByte(':')
		buf.Write(b[k])
	}
	buf.WriteByte('}')
	return buf.Bytes()
}

// Stream reports whether the client asked for a server-sent-event stream.
func (b Body) Stream() bool {
	var s bool
	return json.Unmarshal(b["stream"], &s) == nil && s
}

func (b Body) set(key string, v any) {
	data, err := json.Marshal(v)
	if err != nil {
		panic(fmt.Sprintf("protocol: marshalling %s: %v", key, err))
	}
	b[key] = data
}

// Fields of kv_transfer_params, as vLLM's NIXL schedulers read and write them.
const (
	DoRemoteDecode  = "do_remote_decode"
	DoRemotePrefill = "do_remote_prefill"
	RemoteEngineID  = "remote_engine_id"
	RemoteBlockIDs  = "remote_block_ids"
	RemoteHost      = "remote_host"
	RemotePort      = "remote_port"
	RemoteRequestID = "remote_request_id"
	TPSize          = "tp_size"
	PPSize          = "pp_size"
	TransferID      = "transfer_id"
)

// KVTransferParams is the body field both legs carry.
const KVTransferParams = "kv_transfer_params"

// Prefill is the prefill engine a push decode leg names: what the decode engine needs to
// register its blocks with that engine before prefill ends.
type Prefill struct {
	EngineID string
	// Host and Port are the engine's KV side channel (VLLM_NIXL_SIDE_CHANNEL_HOST/PORT).
	Host string
	Port int32
	TP   int32
	PP   int32
}

// PrefillLeg is the first leg, to a prefill engine: the client's body that computes the
// prompt's KV cache and keeps it for a remote decode. Token limits become 1 (prefill
// produces one token), the response is not streamed, and min_tokens and
// min_completion_tokens are dropped because vLLM refuses them above the token limit.
// transferID is empty in pull mode; in push mode it is the id both legs share, by which
// the prefill side pairs its blocks with the decode engine's registration.
func PrefillLeg(client Body, transferID string) Body {
	b := client.Clone()
	params := map[string]any{
		DoRemoteDecode:  true,
		DoRemotePrefill: false,
		RemoteEngineID:  nil,
		RemoteBlockIDs:  nil,
		RemoteHost:      nil,
		RemotePort:      nil,
	}
	if transferID != "" {
		params[TransferID] = transferID
	}
	b.set(KVTransferParams, params)
	b.set("stream", false)
	delete(b, "stream_options")
	b.set("max_tokens", 1)
	if _, ok := b["max_completion_tokens"]; ok {
		b.set("max_completion_tokens", 1)
	}
	delete(b, "min_tokens")
	delete(b, "min_completion_tokens")
	return b
}

// PullPrefillLeg is pull's prefill leg: PrefillLeg, and for a completion whose prompt the
// decode leg may carry as token ids (idsCarriable) the ids asked back
// (return_token_ids), so that the decode engine does not tokenize the prompt again: in
// pull its intake is on the critical path.
func PullPrefillLeg(client Body) Body {
	b := PrefillLeg(client, "")
	if idsCarriable(client) {
		b.set("return_token_ids", true)
	}
	return b
}

// idsCarriable says whether a body's prompt may be replaced by its token ids: one text
// prompt of /v1/completions (vLLM's chat API takes no token ids, and a batch's choices
// are one per prompt), not echoed (the client would get the ids' detokenization back,
// not its own text), and no prompt embeddings beside it.
func idsCarriable(b Body) bool {
	if p := bytes.TrimSpace(b["prompt"]); len(p) == 0 || p[0] != '"' {
		return false
	}
	var echo bool
	_ = json.Unmarshal(b["echo"], &echo) // absent or not a boolean: vLLM's default, false
	_, embeds := b["prompt_embeds"]
	return !echo && !embeds
}

// PullDecodeLeg is the second leg in pull mode, sent when prefill has returned: the
// client's body with kv_transfer_params set to exactly what the prefill engine returned
// (its block ids, engine id, side channel and TP size), so decode reads the blocks; and,
// when the prefill engine returned the prompt's token ids, those as the prompt (ids says
// so).
func PullDecodeLeg(client Body, prefilled Prefilled) (leg Body, ids bool) {
	b := client.Clone()
	b[KVTransferParams] = prefilled.Params
	if prefilled.PromptIDs != nil && idsCarriable(client) {
		b["prompt"] = prefilled.PromptIDs
		ids = true
	}
	return b, ids
}

// PushDecodeLeg is the second leg in push mode, sent at arrival together with the
// prefill leg: it names the prefill engine (id, side channel, TP and PP size) but no
// block ids. The decode engine allocates its blocks and registers them with that engine;
// requestID is the shared X-Request-Id and transferID pairs the two legs.
func PushDecodeLeg(client Body, p Prefill, requestID, transferID string) Body {
	b := client.Clone()
	b.set(KVTransferParams, map[string]any{
		DoRemoteDecode:  false,
		DoRemotePrefill: true,
		RemoteEngineID:  p.EngineID,
		RemoteHost:      p.Host,
		RemotePort:      p.Port,
		TPSize:          p.TP,
		PPSize:          max(p.PP, 1),
		RemoteRequestID: requestID,
		TransferID:      transferID,
	})
	return b
}

// Prefilled is what a pull decode leg takes from the prefill engine's response.
type Prefilled struct {
	// Params is its kv_transfer_params, an object.
	Params json.RawMessage
	// PromptIDs is the prompt's token ids (return_token_ids), an array of numbers; nil
	// when the response has none.
	PromptIDs json.RawMessage
}

// ReadPrefill reads a prefill engine's response. It is an error when kv_transfer_params
// are missing or not an object: the prefill engine then runs without a P/D connector,
// and a decode leg without them would recompute the whole prompt. The prompt's ids are
// taken only as an array of numbers (the engine's own output, but the decode leg is no
// place to find out otherwise), from the first choice: the one choice of a single prompt.
// One pass of the body's validator, no decoding: with ids, a 16k-token prompt's response
// is 100 KB.
func ReadPrefill(response []byte) (Prefilled, error) {
	r, err := Parse(response)
	if err != nil {
		return Prefilled{}, fmt.Errorf("the prefill response is not a JSON object: %w", err)
	}
	p := bytes.TrimSpace(r[KVTransferParams])
	if len(p) == 0 || bytes.Equal(p, []byte("null")) {
		return Prefilled{}, errors.New("the prefill response has no kv_transfer_params: is the engine running with a P/D KV connector?")
	}
	if p[0] != '{' {
		return Prefilled{}, fmt.Errorf("the prefill response's kv_transfer_params is not an object: %.64s", p)
	}
	out := Prefilled{Params: p}
	first := true
	eachElement(r["choices"], func(choice []byte) {
		if !first {
			return
		}
		first = false
		if c, err := Parse(choice); err == nil {
			ids := bytes.TrimSpace(c["prompt_token_ids"])
			if inner, ok := numbers(ids); ok && len(inner) > 0 {
				out.PromptIDs = ids
			}
		}
	})
	return out, nil
}

// PromptTokens estimates a request's prompt length in tokens for load balancing. The
// router has no tokenizer: a prompt given as token ids counts exactly, text counts at
// about four bytes per token (the usual ratio of BPE vocabularies on English text). It
// walks the raw JSON (valid: Parse checked it) instead of decoding it: a 16k-token prompt
// would otherwise cost the router more than the rest of its work on the request.
func PromptTokens(b Body) int {
	if raw, ok := b["prompt"]; ok {
		return valueTokens(raw)
	}
	n := 0
	eachElement(b["messages"], func(msg []byte) {
		if msg[0] != '{' {
			return
		}
		// The content member as encoding/json would read it (the last of that name, the
		// name matched without case), in one pass over a message that may be the whole
		// prompt.
		var content []byte
		members(msg, func(key, value []byte) {
			if bytes.EqualFold(key, []byte(`"content"`)) {
				content = value
			}
		})
		n += valueTokens(content) + 4 // role and separators
	})
	return n
}

// valueTokens counts a prompt value: text, token ids, a batch of either, or chat
// content parts ({"type":"text","text":…}). It reads each byte once, whatever the nesting
// (a count that rescanned each level cost 3.7 s of CPU on a 1 MiB prompt nested 9,990
// deep), and counts nothing below maxPromptDepth: no prompt form nests deeper.
func valueTokens(raw []byte) int {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 {
		return 0
	}
	// Token ids, the common case: the commas count them (SIMD-backed scans).
	if inner, ok := numbers(raw); ok {
		if len(inner) == 0 {
			return 0
		}
		return bytes.Count(inner, []byte{','}) + 1
	}
	c := tokenCounter{validator: validator{b: raw}}
	c.value(0)
	return c.n
}

// numbers returns the inside of a valid JSON array of numbers (token ids): with no
// string, array or object inside, its elements are numbers.
func numbers(raw []byte) (inner []byte, ok bool) {
	if len(raw) < 2 || raw[0] != '[' {
		return nil, false
	}
	inner = bytes.TrimSpace(raw[1 : len(raw)-1])
	return inner, bytes.IndexAny(inner, "\"[{") < 0
}

// maxPromptDepth is the deepest a prompt's tokens are counted: a batch of chat content
// parts is an array of arrays of objects.
const maxPromptDepth = 4

// tokenCounter walks a valid JSON value once, counting tokens as it steps over them.
type tokenCounter struct {
	validator
	n int
}

func (c *tokenCounter) value(depth int) {
	if c.i >= len(c.b) {
		return
	}
	start := c.i
	switch ch := c.b[c.i]; {
	case depth >= maxPromptDepth:
		c.validator.value(depth)
	case ch == '"':
		c.str()
		c.n += (c.i - start - 2 + 3) / 4
	case ch == '-' || (ch >= '0' && ch <= '9'):
		c.number()
		c.n++ // a token id
	case ch == '[':
		c.i++
		for c.space(); c.i < len(c.b) && c.b[c.i] != ']'; c.space() {
			c.value(depth + 1)
			c.space()
			if c.i < len(c.b) && c.b[c.i] == ',' {
				c.i++
			}
		}
		c.i++
	case ch == '{':
		c.part(depth)
	default:
		c.validator.value(depth)
	}
}

// part counts a content part's "text" and steps over its other members.
func (c *tokenCounter) part(depth int) {
	c.i++
	for c.space(); c.i < len(c.b) && c.b[c.i] != '}'; c.space() {
		key := c.i
		c.str()
		text := string(c.b[key:c.i]) == `"text"`
		c.space()
		c.i++ // :
		c.space()
		if text {
			c.value(depth + 1)
		} else {
			c.validator.value(depth + 1)
		}
		c.space()
		if c.i < len(c.b) && c.b[c.i] == ',' {
			c.i++
		}
	}
	c.i++
}

// eachElement calls fn with each element of a JSON array (nothing for other values),
// stepping over each with the body's validator. The input is valid JSON (Parse checked it).
func eachElement(raw []byte, fn func([]byte)) {
	v := validator{b: raw}
	v.space()
	if v.i >= len(raw) || raw[v.i] != '[' {
		return
	}
	v.i++
	for v.space(); v.i < len(raw) && raw[v.i] != ']'; v.space() {
		start := v.i
		if !v.value(0) {
			return
		}
		fn(raw[start:v.i])
		v.space()
		if v.i < len(raw) && raw[v.i] == ',' {
			v.i++
		}
	}
}
