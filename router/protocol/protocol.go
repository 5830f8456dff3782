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
func Parse(data []byte) (Body, error) {
	var b Body
	dec := json.NewDecoder(bytes.NewReader(data))
	if err := dec.Decode(&b); err != nil {
		return nil, fmt.Errorf("the request body must be a JSON object: %w", err)
	}
	if b == nil {
		return nil, errors.New("the request body must be a JSON object, not null")
	}
	if dec.More() {
		return nil, errors.New("the request body must hold one JSON object and nothing after it")
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

// PullDecodeLeg is the second leg in pull mode, sent when prefill has returned: the
// client's body with kv_transfer_params set to exactly what the prefill engine returned
// (its block ids, engine id, side channel and TP size), so decode reads the blocks.
func PullDecodeLeg(client Body, prefillParams json.RawMessage) Body {
	b := client.Clone()
	b[KVTransferParams] = prefillParams
	return b
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

// PrefillParams extracts kv_transfer_params from a prefill engine's response. It is an
// error when they are missing or not an object: the prefill engine then runs without a
// P/D connector, and a decode leg without them would recompute the whole prompt.
func PrefillParams(response []byte) (json.RawMessage, error) {
	var r struct {
		Params json.RawMessage `json:"kv_transfer_params"`
	}
	if err := json.Unmarshal(response, &r); err != nil {
		return nil, fmt.Errorf("the prefill response is not a JSON object: %w", err)
	}
	p := bytes.TrimSpace(r.Params)
	if len(p) == 0 || bytes.Equal(p, []byte("null")) {
		return nil, errors.New("the prefill response has no kv_transfer_params: is the engine running with a P/D KV connector?")
	}
	if p[0] != '{' {
		return nil, fmt.Errorf("the prefill response's kv_transfer_params is not an object: %.64s", p)
	}
	return r.Params, nil
}

// PromptTokens estimates a request's prompt length in tokens for load balancing. The
// router has no tokenizer: a prompt given as token ids counts exactly, text counts at
// about four bytes per token (the usual ratio of BPE vocabularies on English text).
func PromptTokens(b Body) int {
	if raw, ok := b["prompt"]; ok {
		return promptTokens(raw)
	}
	var msgs []struct {
		Content json.RawMessage `json:"content"`
	}
	if json.Unmarshal(b["messages"], &msgs) != nil {
		return 0
	}
	n := 0
	for _, m := range msgs {
		n += promptTokens(m.Content) + 4 // role and separators
	}
	return n
}

func promptTokens(raw json.RawMessage) int {
	var s string
	if json.Unmarshal(raw, &s) == nil {
		return textTokens(s)
	}
	var ids []int64
	if json.Unmarshal(raw, &ids) == nil {
		return len(ids)
	}
	// A batch of prompts, or chat content parts: sum their parts.
	var parts []json.RawMessage
	if json.Unmarshal(raw, &parts) == nil {
		n := 0
		for _, p := range parts {
			var part struct {
				Text *string `json:"text"`
			}
			if json.Unmarshal(p, &part) == nil && part.Text != nil {
				n += textTokens(*part.Text)
				continue
			}
			n += promptTokens(p)
		}
		return n
	}
	return 0
}

func textTokens(s string) int { return (len(s) + 3) / 4 }
