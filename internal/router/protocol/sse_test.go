package protocol

import "testing"

func TestEvents(t *testing.T) {
	for _, c := range []struct {
		in   string
		want int
	}{
		{"data: {\"choices\":[]}\n\n", 1},
		{"data: {\"a\":1}\n\ndata: {\"a\":2}\n\ndata: [DONE]\n\n", 2},
		{": keep-alive\n\n", 0},
		{"{\"id\":\"cmpl-1\",\"choices\":[{\"text\":\"data: x\"}]}", 0},
		{"data: {\"a\":", 1},
		{"1}\n\n", 0},
	} {
		if got := Events([]byte(c.in)); got != c.want {
			t.Errorf("Events(%q) = %d, want %d", c.in, got, c.want)
		}
	}
}
