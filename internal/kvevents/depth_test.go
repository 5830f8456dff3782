package kvevents

import (
	"bytes"
	"os"
	"strings"
	"testing"

	"github.com/vmihailenco/msgpack/v5"
)

// checkDepth passes vLLM's batches and any value nested within bounds, and refuses
// deep nesting, values cut short, lengths that cannot hold and bytes after the value.
func TestCheckDepthBoundsNestingAndShape(t *testing.T) {
	for _, f := range []string{"testdata/batch-array.msgpack", "testdata/batch-map.msgpack"} {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		if err := checkDepth(b); err != nil {
			t.Errorf("%s: %v", f, err)
		}
	}
	nested := func(depth int) []byte { return append(bytes.Repeat([]byte{0x91}, depth), 0xc0) }
	good, _ := msgpack.Marshal(map[string]any{"a": []any{1, -3, 3.5, "s", []byte{1}, nil, true, map[string]any{"b": strings.Repeat("x", 300)}}, "u": uint64(1 << 40)})
	for name, c := range map[string]struct {
		b  []byte
		ok bool
	}{
		"a value of every kind":          {good, true},
		"31 deep":                        {nested(maxDepth - 1), true},
		"32 deep":                        {nested(maxDepth), false},
		"6 MB deep":                      {nested(6 << 20), false},
		"cut short":                      {good[:len(good)-3], false},
		"an array claiming 2^32-1 items": {[]byte{0xdd, 0xff, 0xff, 0xff, 0xff, 0xc0}, false},
		"bytes after the value":          {append(good, 0xc0), false},
		"an unused type code":            {[]byte{0xc1}, false},
	} {
		if err := checkDepth(c.b); (err == nil) != c.ok {
			t.Errorf("%s: %v, want ok %v", name, err, c.ok)
		}
	}
}
