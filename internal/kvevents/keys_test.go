package kvevents

import (
	"fmt"
	"os"
	"slices"
	"strings"
	"testing"

	"github.com/kvhandoff/kvhandoff/internal/router/prefix"
	"github.com/kvhandoff/kvhandoff/internal/router/protocol"
)

// cut is the router's keys of a completion request of prompt ids.
func cut(t *testing.T, model, salt string, ids []uint32, block int) []prefix.Key {
	t.Helper()
	parts := make([]string, len(ids))
	for i, id := range ids {
		parts[i] = fmt.Sprint(id)
	}
	body := fmt.Sprintf(`{"model":%q,"prompt":[%s]`, model, strings.Join(parts, ","))
	if salt != "" {
		body += fmt.Sprintf(`,"cache_salt":%q`, salt)
	}
	b, err := protocol.Parse([]byte(body + "}"))
	if err != nil {
		t.Fatal(err)
	}
	return prefix.Cut(b, block).Keys
}

func seq(from, n int) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = uint32(from + i)
	}
	return out
}

func hashes(from, n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i], _ = hashString(uint64(from + i))
	}
	return out
}

// vLLM's batches, written by its own classes and encoder (testdata/gen.py), decode to the
// events they hold, in both of the batch's encodings.
func TestDecodeReadsVLLMsBatches(t *testing.T) {
	for _, f := range []string{"batch-array.msgpack", "batch-map.msgpack"} {
		t.Run(f, func(t *testing.T) {
			payload, err := os.ReadFile("testdata/" + f)
			if err != nil {
				t.Fatal(err)
			}
			b, err := DecodeMessage([][]byte{[]byte("kv"), {0, 0, 0, 0, 0, 0, 0, 7}, payload})
			if err != nil {
				t.Fatal(err)
			}
			if b.Seq != 7 || len(b.Events) != 5 {
				t.Fatalf("seq %d, %d events: want 7 and 5", b.Seq, len(b.Events))
			}
			first, ext, lora := b.Events[0], b.Events[1], b.Events[2]
			if first.Kind != KindStored || !slices.Equal(first.Hashes, hashes(11, 2)) || first.Parent != "" || !slices.Equal(first.TokenIDs, seq(100, 64)) ||
				first.BlockSize != 32 || first.Medium != "GPU" || first.SpecKind != fullAttnKind || len(first.ExtraKeys) != 2 ||
				!slices.Equal(first.ExtraKeys[0], []any{"s1"}) || first.ExtraKeys[1] != nil {
				t.Errorf("first store: %+v", first)
			}
			if want, _ := hashString(uint64(12)); ext.Parent != want || ext.ExtraKeys != nil {
				t.Errorf("extending store: %+v", ext)
			}
			if lora.LoRA != "adapter" || lora.Hashes[0] != "b"+strings.Repeat("\x01", 32) {
				t.Errorf("an adapter's store with a bytes hash: %+v", lora)
			}
			if b.Events[3].Kind != KindRemoved || !slices.Equal(b.Events[3].Hashes, hashes(13, 1)) || b.Events[4].Kind != KindCleared {
				t.Errorf("remove and clear: %+v %+v", b.Events[3], b.Events[4])
			}
		})
	}
}

// A message that is not vLLM's is refused with what is wrong, whatever its bytes.
func TestDecodeRefusesMalformedMessages(t *testing.T) {
	payload, _ := os.ReadFile("testdata/batch-array.msgpack")
	seq := []byte{0, 0, 0, 0, 0, 0, 0, 1}
	for name, frames := range map[string][][]byte{
		"two frames":           {[]byte("kv"), payload},
		"short sequence":       {[]byte("kv"), {1}, payload},
		"not msgpack":          {[]byte("kv"), seq, []byte("{}")},
		"empty":                {[]byte("kv"), seq, nil},
		"a number":             {[]byte("kv"), seq, {0x07}},
		"truncated":            {[]byte("kv"), seq, payload[:len(payload)/2]},
		"an event not a map":   {[]byte("kv"), seq, {0x92, 0x01, 0x91, 0x01}},
		"an event with no tag": {[]byte("kv"), seq, {0x92, 0x01, 0x91, 0x80}},
		"a huge array claimed": {[]byte("kv"), seq, {0x92, 0x01, 0xdd, 0xff, 0xff, 0xff, 0xff}},
		// {"type": "BlockStored", "token_ids": [-1]} and [2^32]: not token ids.
		"a negative token id": {[]byte("kv"), seq, append([]byte{0x92, 0x01, 0x91, 0x82, 0xa4, 't', 'y', 'p', 'e', 0xab}, append([]byte("BlockStored"),
			append([]byte{0xa9}, append([]byte("token_ids"), 0x91, 0xff)...)...)...)},
		"a token id of 2^32": {[]byte("kv"), seq, append([]byte{0x92, 0x01, 0x91, 0x82, 0xa4, 't', 'y', 'p', 'e', 0xab}, append([]byte("BlockStored"),
			append([]byte{0xa9}, append([]byte("token_ids"), 0x91, 0xcf, 0, 0, 0, 1, 0, 0, 0, 0)...)...)...)},
	} {
		if _, err := DecodeMessage(frames); err == nil {
			t.Errorf("%s: decoded", name)
		}
	}
	// Every truncation of a real batch is refused, none panics.
	for i := range len(payload) - 1 {
		if _, err := DecodeMessage([][]byte{[]byte("kv"), seq, payload[:i]}); err == nil {
			t.Errorf("%d of %d bytes: decoded", i, len(payload))
		}
	}
}

func stored(hs []string, parent string, ids []uint32, extra ...[]any) Event {
	return Event{Kind: KindStored, Hashes: hs, Parent: parent, TokenIDs: ids, BlockSize: 4, Medium: "GPU", ExtraKeys: extra}
}

// The keys of what vLLM stored are the router's keys of a token-id prompt of the same
// tokens, model and salt: the blocks a request would reuse are the ones it matches.
func TestStoredBlocksAreKeyedAsTheRouterKeysPrompts(t *testing.T) {
	k := NewKeys("m", 100)
	h := hashes(1, 5)
	c := k.Apply(stored(h[:3], "", seq(0, 12)))
	if want := cut(t, "m", "", seq(0, 14), 4); !slices.Equal(c.Added, want) {
		t.Fatalf("3 blocks from the root: %v, the router's %v", c.Added, want)
	}
	// A later prompt extending it stores its new blocks only, chained from the last held.
	c = k.Apply(stored(h[3:5], h[2], seq(12, 8)))
	if want := cut(t, "m", "", seq(0, 20), 4); !slices.Equal(c.Added, want[3:]) {
		t.Fatalf("extension: %v, the router's %v", c.Added, want[3:])
	}
	// A salted prompt (the salt on its first block) and an adapter's (its name on every
	// block) chain from their own roots, as the router's.
	c = k.Apply(stored(hashes(20, 2), "", seq(0, 8), []any{"s1"}, nil))
	if want := cut(t, "m", "s1", seq(0, 8), 4); !slices.Equal(c.Added, want) {
		t.Errorf("salted: %v, the router's %v", c.Added, want)
	}
	e := stored(hashes(30, 2), "", seq(0, 8), []any{"ad", "s2"}, []any{"ad"})
	e.LoRA = "ad"
	if c = k.Apply(e); !slices.Equal(c.Added, cut(t, "ad", "s2", seq(0, 8), 4)) {
		t.Errorf("an adapter's salted blocks: %v", c.Added)
	}
	if k.Len() != 9 {
		t.Errorf("%d blocks held, want 9", k.Len())
	}
	// Removal names the keys removed; a hash not held changes nothing.
	c = k.Apply(Event{Kind: KindRemoved, Hashes: append(hashes(5, 1), hashes(99, 1)...), Medium: "GPU"})
	if want := cut(t, "m", "", seq(0, 20), 4)[4:]; !slices.Equal(c.Removed, want) || k.Len() != 8 {
		t.Errorf("removed %v (%d held), want %v", c.Removed, k.Len(), want)
	}
	if c = k.Apply(Event{Kind: KindCleared}); !c.Cleared || k.Len() != 0 {
		t.Errorf("cleared: %+v, %d held", c, k.Len())
	}
}

// What the router could not match exactly is left out, with everything after it: the
// index may hold less than the engine, never more.
func TestBlocksTheRouterCannotKeyAreLeftOut(t *testing.T) {
	for _, tc := range []struct {
		name   string
		event  Event
		reason string
		added  int
	}{
		{"a multimodal pair on the second block", stored(hashes(1, 3), "", seq(0, 12), nil, []any{[]any{"img", 0}}, nil), SkipUnkeyed, 1},
		{"two extra keys on the first", stored(hashes(1, 1), "", seq(0, 4), []any{"s1", "digest"}), SkipUnkeyed, 0},
		{"a salt on a later block", stored(hashes(1, 2), "", seq(0, 8), nil, []any{"s1"}), SkipUnkeyed, 1},
		{"a parent never seen", stored(hashes(1, 2), hashes(50, 1)[0], seq(0, 8)), SkipNoParent, 0},
		{"the CPU tier", func() Event { e := stored(hashes(1, 1), "", seq(0, 4)); e.Medium = "CPU"; return e }(), SkipOtherTier, 0},
		{"another group", func() Event { e := stored(hashes(1, 1), "", seq(0, 4)); e.Group = 1; return e }(), SkipOtherTier, 0},
		{"ids short of the blocks", stored(hashes(1, 2), "", seq(0, 7)), SkipMalformed, 0},
		{"extra keys not one a block", stored(hashes(1, 2), "", seq(0, 8), nil), SkipMalformed, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			k := NewKeys("m", 100)
			k.Apply(stored(hashes(60, 1), "", seq(500, 4))) // follow group 0
			c := k.Apply(tc.event)
			if len(c.Added) != tc.added || c.Skipped[tc.reason] != len(tc.event.Hashes)-tc.added {
				t.Errorf("added %d, skipped %v: want %d added, the rest as %s", len(c.Added), c.Skipped, tc.added, tc.reason)
			}
		})
	}
	k := NewKeys("m", 3)
	if c := k.Apply(stored(hashes(1, 5), "", seq(0, 20))); len(c.Added) != 3 || c.Skipped[SkipFull] != 2 {
		t.Errorf("beyond MaxBlocks: %+v", c)
	}
}
