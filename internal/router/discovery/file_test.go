package discovery

import (
	"os"
	"path/filepath"
	"testing"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
)

// A file's routing gets the API's defaults for what it leaves out, as a KVTransferPolicy
// does from the API server: decodeChoice PrefixAware alone once weighed prefixes by 0
// (load only, without an error). What it sets, 0 included, stays.
func TestAFilesRoutingGetsTheAPIsDefaults(t *testing.T) {
	for _, c := range []struct {
		routing string
		want    kvv1.RoutingSpec
	}{
		{`{"decodeChoice":"PrefixAware"}`, kvv1.RoutingSpec{DecodeChoice: kvv1.DecodeChoicePrefixAware, PrefixSource: kvv1.PrefixSourceKVEvents,
			OverlapWeight: kvv1.DefaultOverlapWeight, LoadWeight: kvv1.DefaultLoadWeight}},
		{`{"decodeChoice":"PrefixAware","overlapWeight":0,"loadWeight":3,"prefixSource":"RoutingHistory","minPrefillTokens":64}`,
			kvv1.RoutingSpec{DecodeChoice: kvv1.DecodeChoicePrefixAware, PrefixSource: kvv1.PrefixSourceRoutingHistory, LoadWeight: 3, MinPrefillTokens: 64}},
		{`{}`, kvv1.RoutingSpec{DecodeChoice: kvv1.DecodeChoiceLoadOnly, PrefixSource: kvv1.PrefixSourceKVEvents,
			OverlapWeight: kvv1.DefaultOverlapWeight, LoadWeight: kvv1.DefaultLoadWeight}},
	} {
		file := filepath.Join(t.TempDir(), "endpoints.json")
		_ = os.WriteFile(file, []byte(`{"mode":"Pull","prefill":[{"url":"http://127.0.0.1:1","engineID":"p"}],"decode":[{"url":"http://127.0.0.1:2","engineID":"d"}],"routing":`+c.routing+`}`), 0o644)
		s, err := ReadFile(file)
		if err != nil {
			t.Fatal(err)
		}
		if *s.Routing != c.want {
			t.Errorf("routing %s: read as %+v, want %+v", c.routing, *s.Routing, c.want)
		}
	}
}
