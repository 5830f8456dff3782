package protocol

import (
	"encoding/json"
	"reflect"
	"strings"
	"testing"
)

// client is a body with fields the router does not own, spelled in ways a re-encoding
// would change (spacing, number formats, key order inside objects).
const client = `{"model":"qwen","prompt":"hello world","max_tokens":64,"max_completion_tokens":64,` +
	`"min_tokens":8,"min_completion_tokens":8,"stream":true,"stream_options":{"include_usage":true},` +
	`"temperature":0.70,"logit_bias":{"b":1, "a":2},"seed":1e3,"kv_transfer_params":{"injected":true}}`

func mustParse(t *testing.T, s string) Body {
	t.Helper()
	b, err := Parse([]byte(s))
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// passthrough checks that every field of the client's body that the leg does not own
// reaches the leg byte for byte.
func passthrough(t *testing.T, leg Body, owned ...string) {
	t.Helper()
	c := mustParse(t, client)
	for k, v := range c {
		if contains(owned, k) {
			continue
		}
		if string(leg[k]) != string(v) {
			t.Errorf("field %s: leg has %s, client sent %s", k, leg[k], v)
		}
	}
}

func contains(s []string, k string) bool {
	for _, x := range s {
		if x == k {
			return true
		}
	}
	return false
}

func params(t *testing.T, b Body) map[string]any {
	t.Helper()
	var p map[string]any
	if err := json.Unmarshal(b[KVTransferParams], &p); err != nil {
		t.Fatalf("kv_transfer_params %s: %v", b[KVTransferParams], err)
	}
	return p
}

func TestPullPrefillLegIsVLLMsFirstLeg(t *testing.T) {
	leg := PrefillLeg(mustParse(t, client), "")
	want := map[string]string{
		"stream": "false", "max_tokens": "1", "max_completion_tokens": "1",
		KVTransferParams: `{"do_remote_decode":true,"do_remote_prefill":false,"remote_block_ids":null,"remote_engine_id":null,"remote_host":null,"remote_port":null}`,
	}
	for k, v := range want {
		if string(leg[k]) != v {
			t.Errorf("%s = %s, want %s", k, leg[k], v)
		}
	}
	for _, k := range []string{"stream_options", "min_tokens", "min_completion_tokens"} {
		if _, ok := leg[k]; ok {
			t.Errorf("%s must be dropped from the prefill leg", k)
		}
	}
	passthrough(t, leg, "stream", "stream_options", "max_tokens", "max_completion_tokens", "min_tokens", "min_completion_tokens", KVTransferParams)
}

func TestPrefillLegSetsMaxTokensEvenWhenTheClientDidNot(t *testing.T) {
	leg := PrefillLeg(mustParse(t, `{"prompt":"x"}`), "")
	if string(leg["max_tokens"]) != "1" {
		t.Errorf("max_tokens = %s, want 1", leg["max_tokens"])
	}
	if _, ok := leg["max_completion_tokens"]; ok {
		t.Error("max_completion_tokens added although the client did not send it")
	}
}

func TestPushPrefillLegCarriesTheTransferID(t *testing.T) {
	p := params(t, PrefillLeg(mustParse(t, client), "xfer-1"))
	if p[TransferID] != "xfer-1" || p[DoRemoteDecode] != true || p[DoRemotePrefill] != false {
		t.Errorf("push prefill params %v", p)
	}
}

func TestPullDecodeLegCarriesExactlyWhatPrefillReturned(t *testing.T) {
	returned := `{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[[1,2,3]],"remote_engine_id":"p-0.ns","remote_request_id":"r1","remote_host":"198.18.0.1","remote_port":5600,"tp_size":8,"extra":{"x": 1}}`
	p, err := ReadPrefill([]byte(`{"id":"cmpl-1","kv_transfer_params":` + returned + `}`))
	if err != nil {
		t.Fatal(err)
	}
	leg, ids := PullDecodeLeg(mustParse(t, client), p)
	if ids {
		t.Error("the decode leg says it carries token ids the response did not have")
	}
	if string(leg[KVTransferParams]) != returned {
		t.Errorf("decode params %s, want %s", leg[KVTransferParams], returned)
	}
	passthrough(t, leg, KVTransferParams)
}

func TestPullCarriesATextCompletionsPromptAsPrefillsTokenIDs(t *testing.T) {
	if leg := PullPrefillLeg(mustParse(t, client)); string(leg["return_token_ids"]) != "true" {
		t.Errorf("the prefill leg of a text completion asks return_token_ids %s, want true", leg["return_token_ids"])
	}
	resp := `{"choices":[{"index":0,"text":"x","prompt_token_ids":[5, 17,3],"token_ids":[9]}],"kv_transfer_params":{"remote_block_ids":[[1]]}}`
	p, err := ReadPrefill([]byte(resp))
	if err != nil {
		t.Fatal(err)
	}
	leg, ids := PullDecodeLeg(mustParse(t, client), p)
	if string(leg["prompt"]) != "[5, 17,3]" || !ids {
		t.Errorf("decode prompt %s, want the prefill's ids [5, 17,3]", leg["prompt"])
	}
	passthrough(t, leg, KVTransferParams, "prompt")

	// Without ids in the response (an engine that ignores return_token_ids), or ids
	// that are not an array of numbers, the client's prompt goes as it came.
	for _, resp := range []string{
		`{"choices":[{"text":"x"}],"kv_transfer_params":{}}`,
		`{"choices":[{"prompt_token_ids":["5"]}],"kv_transfer_params":{}}`,
		`{"choices":[{"prompt_token_ids":[[5]]}],"kv_transfer_params":{}}`,
		`{"choices":[{"prompt_token_ids":[]}],"kv_transfer_params":{}}`,
		`{"choices":[{"prompt_token_ids":null}],"kv_transfer_params":{}}`,
		`{"choices":["x",{"prompt_token_ids":[5]}],"kv_transfer_params":{}}`,
		`{"choices":{"prompt_token_ids":[5]},"kv_transfer_params":{}}`,
	} {
		p, err := ReadPrefill([]byte(resp))
		if err != nil {
			t.Fatalf("%s: %v", resp, err)
		}
		if leg, ids := PullDecodeLeg(mustParse(t, client), p); string(leg["prompt"]) != `"hello world"` || ids {
			t.Errorf("%s: decode prompt %s, want the client's", resp, leg["prompt"])
		}
	}
}

func TestPullKeepsPromptsTokenIDsCannotStandFor(t *testing.T) {
	ids := Prefilled{Params: []byte(`{}`), PromptIDs: []byte(`[5,17]`)}
	for _, body := range []string{
		`{"messages":[{"role":"user","content":"hi"}]}`, // chat: vLLM takes no ids
		`{"prompt":["a","b"]}`,                          // a batch: a choice per prompt
		`{"prompt":[1,2]}`,                              // ids already
		`{"prompt":"a","echo":true}`,                    // the client would get the ids' text back
		`{"prompt":"a","prompt_embeds":"AAAA"}`,
	} {
		c := mustParse(t, body)
		if _, ok := PullPrefillLeg(c)["return_token_ids"]; ok {
			t.Errorf("%s: the prefill leg asks for token ids", body)
		}
		if leg, carried := PullDecodeLeg(c, ids); string(leg["prompt"]) != string(c["prompt"]) || carried {
			t.Errorf("%s: decode prompt %s, want the client's %s", body, leg["prompt"], c["prompt"])
		}
	}
}

func TestPushDecodeLegNamesThePrefillEngineButNoBlocks(t *testing.T) {
	leg := PushDecodeLeg(mustParse(t, client), Prefill{EngineID: "p-0.ns", Host: "198.18.0.1", Port: 5600, TP: 8}, "req-1", "xfer-1")
	p := params(t, leg)
	want := map[string]any{
		DoRemoteDecode: false, DoRemotePrefill: true, RemoteEngineID: "p-0.ns", RemoteHost: "198.18.0.1",
		RemotePort: 5600.0, TPSize: 8.0, PPSize: 1.0, RemoteRequestID: "req-1", TransferID: "xfer-1",
	}
	if len(p) != len(want) {
		t.Errorf("push decode params %v, want exactly %v", p, want)
	}
	for k, v := range want {
		if p[k] != v {
			t.Errorf("%s = %v, want %v", k, p[k], v)
		}
	}
	if _, ok := p[RemoteBlockIDs]; ok {
		t.Error("a push decode leg must not carry block ids: decode allocates and registers its own")
	}
	passthrough(t, leg, KVTransferParams)
}

func TestReadPrefillRefusesResponsesWithoutParams(t *testing.T) {
	for _, resp := range []string{`{"id":"x"}`, `{"kv_transfer_params":null}`, `{"kv_transfer_params":[1]}`, `not json`} {
		if _, err := ReadPrefill([]byte(resp)); err == nil {
			t.Errorf("%s: accepted", resp)
		}
	}
}

func TestParseRefusesWhatIsNotOneObject(t *testing.T) {
	for _, s := range []string{``, `null`, `[1]`, `"x"`, `{"a":1} {"b":2}`, `{"a":`} {
		if _, err := Parse([]byte(s)); err == nil {
			t.Errorf("%q: accepted", s)
		}
	}
}

func TestPromptTokens(t *testing.T) {
	for _, c := range []struct {
		body string
		want int
	}{
		{`{"prompt":[1,2,3,4,5]}`, 5},
		{`{"prompt":"` + strings.Repeat("abcd", 100) + `"}`, 100},
		{`{"prompt":["abcdabcd","abcd"]}`, 3},
		{`{"messages":[{"role":"user","content":"abcdabcd"}]}`, 6},
		{`{"messages":[{"role":"user","content":[{"type":"text","text":"abcdabcd"}]}]}`, 6},
		// As encoding/json reads a message: the name without case, the last one, a
		// message with no content its separators, an element not an object nothing.
		{`{"messages":[{"role":"user","Content":"abcdabcd"},{"content":"ab","content":"abcdabcdabcd"},{"role":"assistant"},"abcd"]}`, 6 + 7 + 4},
		{`{"model":"x"}`, 0},
		{`{"prompt":[[1,2],[3]]}`, 3},
		{`{"prompt":[[[[[1,2,3]]]]]}`, 0}, // below any prompt form: not counted
		{`{"prompt":[1,"abcd",[2,[3]]]}`, 4},
	} {
		if got := PromptTokens(mustParse(t, c.body)); got != c.want {
			t.Errorf("%s: %d tokens, want %d", c.body, got, c.want)
		}
	}
}

func TestMarshalKeepsTheClientsBytes(t *testing.T) {
	b := mustParse(t, `{"z": {"b":1, "a":[1, 2]},"n":1e3,"s":"\u00e9"}`)
	if got, want := string(b.Marshal()), `{"n":1e3,"s":"\u00e9","z":{"b":1, "a":[1, 2]}}`; got != want {
		t.Errorf("Marshal = %s, want %s", got, want)
	}
	if _, err := Parse(b.Marshal()); err != nil {
		t.Error(err)
	}
}

// FuzzParseAgreesWithEncodingJSON: the hand walk over members must see exactly the
// object encoding/json sees, or a client could smuggle a field past the router.
func FuzzParseAgreesWithEncodingJSON(f *testing.F) {
	for _, s := range []string{
		client, `{}`, ` { "a" : [ 1 , { "b" : "]}" } ] , "c":"\"}" , "d" : -1.5e3 }`,
		`{"kv_transfer_params":{"x":1},"kv_transfer_params":null}`, `{"a":"\\","b":[[],{}]}`,
		`{"prompt":[1,2,3]}`, `[1]`, `{"a":1}x`, `{"a":tru}`, "{\"\\u0061\":1,\"a\":2}",
		`{"a":01}`, `{"a":-}`, `{"a":1.}`, `{"a":1e}`, `{"a":"\x"}`, "{\"a\":\"\x01\"}", `{"a":"\u12G4"}`,
		`{"a":[1,]}`, `{"a":1,}`, `{,}`, ` {"a" :1 } `, "{\"a\":\"\xff\xfe\"}", `{"a":[[[[]]]]}`, `{"a":-0.0e+5}`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		got, err := Parse(data)
		var want map[string]any
		werr := json.Unmarshal(data, &want)
		if werr != nil || want == nil {
			if err == nil {
				t.Fatalf("Parse accepted %q, which encoding/json refuses as an object (%v)", data, werr)
			}
			return
		}
		if err != nil {
			t.Fatalf("Parse refused %q: %v", data, err)
		}
		if len(got) != len(want) {
			t.Fatalf("%q: Parse saw %d members, encoding/json %d", data, len(got), len(want))
		}
		for k, v := range want {
			var g any
			if err := json.Unmarshal(got[k], &g); err != nil {
				t.Fatalf("%q: member %q is %q: %v", data, k, got[k], err)
			}
			if !reflect.DeepEqual(g, v) {
				t.Fatalf("%q: member %q is %v, encoding/json says %v", data, k, g, v)
			}
		}
		var round map[string]any
		if err := json.Unmarshal(got.Marshal(), &round); err != nil || !reflect.DeepEqual(round, want) {
			t.Fatalf("%q: Marshal gave %q (%v)", data, got.Marshal(), err)
		}
	})
}

func TestParseRefusesNestingDeeperThanEncodingJSONAllows(t *testing.T) {
	deep := `{"a":` + strings.Repeat("[", 20000) + strings.Repeat("]", 20000) + `}`
	if _, err := Parse([]byte(deep)); err == nil {
		t.Error("a body nested 20000 deep was accepted")
	}
	ok := `{"a":` + strings.Repeat("[", 9000) + strings.Repeat("]", 9000) + `}`
	if _, err := Parse([]byte(ok)); err != nil {
		t.Errorf("nesting 9000 deep, which encoding/json accepts, refused: %v", err)
	}
}
