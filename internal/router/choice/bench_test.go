package choice

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"

	"github.com/kvhandoff/kvhandoff/internal/router/discovery"
	"github.com/kvhandoff/kvhandoff/internal/router/prefix"
	"github.com/kvhandoff/kvhandoff/internal/router/protocol"
)

// BenchmarkPush16k is engine choice's work on the request path for a conversation's next
// turn, 16k tokens of history plus 256 new, over 4 prefill and 8 decode engines whose
// indexes are full (65,536 blocks each, the default bound): cutting the prompt into keys,
// matching them on every candidate, choosing both engines and recording the choice. Load
// only is the same path without the prefix (what the router did before PrefixAware).
func BenchmarkPush16k(b *testing.B) {
	const history, turn, conversations = 16384, 256, 64
	chat := func(conv, n int) protocol.Body {
		// n tokens of chat at the router's 4 bytes a token.
		msg := strings.Repeat(fmt.Sprintf("conversation %08d says ", conv), n*4/len("conversation 00000000 says "))
		raw, _ := json.Marshal(map[string]any{"model": "m", "messages": []map[string]string{{"role": "user", "content": msg}}})
		body, err := protocol.Parse(raw)
		if err != nil {
			b.Fatal(err)
		}
		return body
	}
	for _, form := range []struct {
		name string
		body func(conv, n int) protocol.Body
	}{{"token_ids", func(conv, n int) protocol.Body { return ids(conv, 0, n) }}, {"chat", chat}} {
		for _, mode := range []struct {
			name    string
			routing Routing
		}{{"load_only", RoutingOf(&discovery.Set{BlockSize: 16})}, {"prefix_aware", prefixAware(0)}} {
			b.Run(form.name+"/"+mode.name, func(b *testing.B) {
				c, _ := newChooser()
				var prefills, decodes []discovery.Engine
				for i := range 4 {
					prefills = append(prefills, engine(fmt.Sprintf("p%d", i), "a"))
				}
				for i := range 8 {
					decodes = append(decodes, engine(fmt.Sprintf("d%d", i), "a"))
				}
				for conv := range conversations {
					keys := prefix.Cut(form.body(conv, history), 16).Keys
					for _, e := range append(prefills, decodes...) {
						c.ix.Add(e.EngineID, keys)
					}
				}
				body := form.body(7, history+turn)
				b.SetBytes(int64(len(body["prompt"]) + len(body["messages"])))
				for b.Loop() {
					p, d, _ := c.Push(mode.routing, prefills, decodes, NewRequest(mode.routing, body, protocol.PromptTokens(body)))
					p.Release()
					d.Release()
				}
			})
		}
	}
}
