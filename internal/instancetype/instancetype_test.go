package instancetype

import (
	"strings"
	"testing"
)

func TestEFACount(t *testing.T) {
	cases := []struct {
		name         string
		accelerators int32
		instanceType string
		override     int32
		want         int32
		wantErr      string
	}{
		{"p5en: 2 per GPU", 8, "p5en.48xlarge", 0, 16, ""},
		{"p5en TP4: the 8 NICs next to 4 GPUs", 4, "p5en.48xlarge", 0, 8, ""},
		{"p5: 4 per GPU", 8, "p5.48xlarge", 0, 32, ""},
		{"trn2: 1 per Neuron device", 4, "trn2.48xlarge", 0, 4, ""},
		{"trn1: 1 per 2 devices", 16, "trn1.32xlarge", 0, 8, ""},
		{"trn1: an odd device still reaches a NIC", 3, "trn1.32xlarge", 0, 2, ""},
		{"override wins over the table", 8, "p5en.48xlarge", 1, 8, ""},
		{"override serves unknown types", 8, "g6.48xlarge", 2, 16, ""},
		{"unknown type without override", 8, "g6.48xlarge", 0, 0, `instanceType "g6.48xlarge" is not in kvhandoff's table`},
		{"no type without override", 8, "", 0, 0, "the pool sets no instanceType"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			got, err := EFACount(c.accelerators, c.instanceType, c.override)
			if c.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), c.wantErr) {
					t.Fatalf("error = %v, want one containing %q", err, c.wantErr)
				}
				return
			}
			if err != nil || got != c.want {
				t.Fatalf("EFACount = %d, %v; want %d", got, err, c.want)
			}
		})
	}
}
