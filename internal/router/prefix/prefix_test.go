package prefix

import (
	"encoding/binary"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"

	"github.com/kvhandoff/kvhandoff/internal/router/protocol"
)

func body(t *testing.T, s string) protocol.Body {
	t.Helper()
	b, err := protocol.Parse([]byte(s))
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func idList(from, n int) string {
	parts := make([]string, n)
	for i := range parts {
		parts[i] = fmt.Sprint(from + i)
	}
	return "[" + strings.Join(parts, ", ") + "]"
}

// Token-id prompts are cut where vLLM cuts them: whole blocks only, the partial last one
// left out; a longer prompt's keys extend a shorter one's, and the model and cache_salt
// start chains of their own.
func TestCutFollowsVLLMsBlocks(t *testing.T) {
	short := Cut(body(t, `{"model":"m","prompt":`+idList(0, 40)+`}`), 16)
	long := Cut(body(t, `{"model":"m","prompt":`+idList(0, 64)+`}`), 16)
	if len(short.Keys) != 2 || len(long.Keys) != 4 || !short.Exact || short.Tokens != 40 {
		t.Fatalf("40 and 64 tokens: %d and %d keys (exact %v, %d tokens), want 2 and 4", len(short.Keys), len(long.Keys), short.Exact, short.Tokens)
	}
	if !slices.Equal(short.Keys, long.Keys[:2]) {
		t.Error("a longer prompt's first blocks have keys of their own")
	}
	other := Cut(body(t, `{"model":"m","prompt":`+idList(1, 64)+`}`), 16)
	salted := Cut(body(t, `{"model":"m","cache_salt":"tenant-a","prompt":`+idList(0, 64)+`}`), 16)
	lora := Cut(body(t, `{"model":"m-lora","prompt":`+idList(0, 64)+`}`), 16)
	for name, p := range map[string]Prompt{"other tokens": other, "a cache_salt": salted, "another model": lora} {
		if p.Keys[0] == long.Keys[0] {
			t.Errorf("%s: same first key", name)
		}
	}
}

// Text and chat prompts are cut into 4×block-size bytes of their JSON; a conversation's
// next turn (more text, or more messages) extends the keys of the last.
func TestTextAndChatPromptsExtendTheirLastTurn(t *testing.T) {
	turn1 := strings.Repeat("You are a helpful assistant. ", 10)
	turn2 := turn1 + " The answer was 42. Why?"
	a, b := Cut(body(t, `{"model":"m","prompt":"`+turn1+`"}`), 16), Cut(body(t, `{"model":"m","prompt":"`+turn2+`"}`), 16)
	if a.Exact || len(a.Keys) != (len(turn1)+1)/64 || len(b.Keys) < len(a.Keys) || !slices.Equal(a.Keys, b.Keys[:len(a.Keys)]) {
		t.Fatalf("text: %d then %d keys, the first not a prefix of the second", len(a.Keys), len(b.Keys))
	}
	msgs := `{"role":"system","content":"` + turn1 + `"},{"role":"user","content":"hello"}`
	c1 := Cut(body(t, `{"model":"m","messages":[`+msgs+`]}`), 16)
	c2 := Cut(body(t, `{"model":"m","messages":[`+msgs+`,{"role":"assistant","content":"hi"},{"role":"user","content":"more"}]}`), 16)
	if len(c1.Keys) == 0 || !slices.Equal(c1.Keys, c2.Keys[:len(c1.Keys)]) {
		t.Fatalf("chat: %d then %d keys, the first not a prefix of the second", len(c1.Keys), len(c2.Keys))
	}
	for _, s := range []string{`{"prompt":["a","b"]}`, `{"prompt":[1,2,"x"]}`, `{"prompt":[-1]}`,
		`{"prompt":[4294967296]}`, `{"prompt":[1.5]}`, `{}`} {
		if p := Cut(body(t, s), 1); len(p.Keys) != 0 || p.Exact {
			t.Errorf("%s: %d keys (exact %v), want none", s, len(p.Keys), p.Exact)
		}
	}
	if p := Cut(body(t, `{"prompt":[ 1 , 2,3 ]}`), 1); len(p.Keys) != 3 || !p.Exact {
		t.Errorf("spaced ids: %d keys, want 3", len(p.Keys))
	}
}

// What an engine can reuse of its matched blocks: all of them, unless they are the whole
// of a prompt of whole blocks, whose last block vLLM computes again.
func TestUsableLeavesVLLMsLastBlock(t *testing.T) {
	for _, tc := range []struct{ tokens, matched, want int }{{40, 2, 2}, {32, 2, 1}, {33, 2, 2}, {16, 1, 0}, {0, 0, 0}} {
		if got := (Prompt{Tokens: tc.tokens, Exact: true}).Usable(tc.matched, 16); got != tc.want {
			t.Errorf("%d tokens, %d matched: %d usable, want %d", tc.tokens, tc.matched, got, tc.want)
		}
	}
	if got := (Prompt{Tokens: 32}).Usable(2, 16); got != 2 {
		t.Errorf("text: %d usable, want 2 (its blocks are estimates)", got)
	}
}

func keys(from, n int) []Key {
	k := make([]Key, n)
	for i := range k {
		k[i] = Key(from + i)
	}
	return k
}

// The index, operation by operation.
func TestIndexInsertMatchEvict(t *testing.T) {
	ix := NewIndex(8)
	ix.Add("d1", keys(0, 4))
	if got := ix.Match("d1", keys(0, 6)); got != 4 {
		t.Errorf("match of 6 keys, 4 held: %d", got)
	}
	if got := ix.Match("d1", []Key{0, 1, 99, 100}); got != 2 {
		t.Errorf("a chain that leaves the one held at its third key: %d, want 2", got)
	}
	if ix.Match("d2", keys(0, 4)) != 0 {
		t.Error("d2 holds nothing")
	}
	// Over capacity the least recently used go first, a prompt's leaf before its root.
	ix.Add("d1", keys(100, 6)) // 10 keys for 8 slots: 2 evicted
	if got := ix.Match("d1", keys(0, 4)); got != 2 {
		t.Errorf("after adding 6 more to 8 slots, the first prompt matches %d blocks, want its first 2", got)
	}
	if ix.Len("d1") != 8 || ix.Total() != 8 {
		t.Errorf("len %d, total %d, want 8", ix.Len("d1"), ix.Total())
	}
	// Serving a prompt again renews its blocks, matching alone does not: the first
	// prompt's 2 blocks, served again, outlive the second prompt's, only matched.
	ix.Add("d1", keys(0, 2))
	ix.Match("d1", keys(100, 6))
	ix.Add("d1", keys(200, 6))
	if got, other := ix.Match("d1", keys(0, 2)), ix.Match("d1", keys(100, 6)); got != 2 || other != 0 {
		t.Errorf("after 6 more: the prompt served again matches %d (want 2), the one matched %d (want 0: its root went)", got, other)
	}
	// Capacity follows the engine's KV size, within the bound.
	ix.SetCapacity("d1", 3)
	if ix.Len("d1") != 3 {
		t.Errorf("after SetCapacity(3): %d held", ix.Len("d1"))
	}
	ix.SetCapacity("d1", 1000)
	ix.Add("d1", keys(300, 20))
	if ix.Len("d1") != 8 {
		t.Errorf("capacity 1000 under a bound of 8: %d held", ix.Len("d1"))
	}
	// A restarted engine or one gone: nothing held.
	ix.Add("d2", keys(0, 2))
	ix.Clear("d1")
	ix.Keep(map[string]bool{"d1": true})
	if ix.Len("d1") != 0 || ix.Len("d2") != 0 || ix.Total() != 0 {
		t.Errorf("after Clear(d1) and Keep(d1): %d and %d held", ix.Len("d1"), ix.Len("d2"))
	}
}

// Under random operations the set agrees with a plain LRU model and never exceeds its
// capacity, whatever the order of adds, matches, removes and resizes.
func TestIndexAgreesWithAModelLRU(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	s := newSet(16)
	var model []Key // least recently used first
	touch := func(k Key) {
		if i := slices.Index(model, k); i >= 0 {
			model = slices.Delete(model, i, i+1)
		} else if len(model) >= s.capacity {
			model = model[1:]
		}
		model = append(model, k)
	}
	for step := range 20000 {
		k := Key(rng.IntN(40))
		switch op := rng.IntN(10); {
		case op < 6:
			s.touch(k)
			touch(k)
		case op < 9:
			s.remove(k)
			if i := slices.Index(model, k); i >= 0 {
				model = slices.Delete(model, i, i+1)
			}
		default:
			c := 1 + rng.IntN(20)
			s.resize(c)
			if len(model) > c {
				model = model[len(model)-c:]
			}
		}
		if len(s.at) != len(model) || len(s.at) > s.capacity {
			t.Fatalf("step %d: %d held, model %d, capacity %d", step, len(s.at), len(model), s.capacity)
		}
		// Walk from least recently used: the same order as the model.
		i := 0
		for j := s.tail; j >= 0; j = s.slots[j].prev {
			if s.slots[j].key != model[i] {
				t.Fatalf("step %d: position %d holds %d, model %d", step, i, s.slots[j].key, model[i])
			}
			i++
		}
	}
}

// Match's binary search rests on the index holding a block only with every block before
// it in its chain. Conversations that share a system prompt and branch, added, resized and
// evicted at random, keep that: Match agrees with counting the held blocks one by one.
func TestMatchAgreesWithALinearCount(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	// chains[c] is conversation c's blocks: a shared head of 5, then its own; a later
	// turn of a conversation extends its chain.
	chains := make([][]Key, 12)
	for c := range chains {
		chains[c] = keys(0, 5)
	}
	ix := NewIndex(64)
	for step := range 5000 {
		c := rng.IntN(len(chains))
		switch op := rng.IntN(20); {
		case op < 12: // a turn: the conversation grows and is served
			for range 1 + rng.IntN(8) {
				chains[c] = append(chains[c], Key(1000*(c+1)+len(chains[c])))
			}
			ix.Add("e", chains[c])
		case op < 18: // an older turn served again
			ix.Add("e", chains[c][:1+rng.IntN(len(chains[c]))])
		case op < 19:
			ix.SetCapacity("e", 1+rng.IntN(80))
		default:
			chains[c] = chains[c][:5] // the conversation starts over
		}
		for _, chain := range chains {
			held := 0
			ix.mu.Lock()
			for held < len(chain) && ix.engines["e"].has(chain[held]) {
				held++
			}
			gaps := 0
			for _, k := range chain[held:] {
				if ix.engines["e"].has(k) {
					gaps++
				}
			}
			ix.mu.Unlock()
			if got := ix.Match("e", chain); got != held || gaps > 0 {
				t.Fatalf("step %d: Match %d, held one by one %d, %d held after the first missing", step, got, held, gaps)
			}
		}
	}
}

// The id scan agrees with encoding/json on flat arrays of ids, and refuses the rest.
func TestTokenIDsReadsWhatJSONReads(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 6))
	space := []string{"", " ", "\n", "\t ", "\r\n"}
	for range 2000 {
		ids := make([]uint32, rng.IntN(6))
		var b strings.Builder
		b.WriteString("[" + space[rng.IntN(len(space))])
		for i := range ids {
			ids[i] = rng.Uint32() >> rng.IntN(32)
			if i > 0 {
				b.WriteString(space[rng.IntN(len(space))] + "," + space[rng.IntN(len(space))])
			}
			fmt.Fprint(&b, ids[i])
		}
		b.WriteString(space[rng.IntN(len(space))] + "]")
		got, ok := tokenIDs([]byte(b.String()))
		var want []uint32
		if err := json.Unmarshal([]byte(b.String()), &want); err != nil || !ok || len(got) != 4*len(want) {
			t.Fatalf("%q: ok %v, %d bytes; json %v %v", b.String(), ok, len(got), want, err)
		}
		for i, id := range want {
			if binary.LittleEndian.Uint32(got[4*i:]) != id {
				t.Fatalf("%q: id %d read as %d", b.String(), id, binary.LittleEndian.Uint32(got[4*i:]))
			}
		}
	}
	for _, s := range []string{`[1,]`, `[,1]`, `[1 2]`, `[1,,2]`, `[4294967296]`, `[99999999999]`, `[-1]`, `[1.5]`, `[1e3]`, `["1"]`, `[[1]]`, `[`, `1`, `[ , ]`} {
		if _, ok := tokenIDs([]byte(s)); ok {
			t.Errorf("%s read as ids", s)
		}
	}
}
