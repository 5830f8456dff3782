package protocol

import "bytes"

// Events counts the server-sent events that carry tokens in p, a piece of a streamed
// response as it was read: the lines that start with "data:", less the final
// "data: [DONE]". vLLM sends one event per engine step, so their gaps are the token gaps
// a client sees (several tokens to an event count as one gap, as the client sees them).
// An event split across two reads counts in the read that holds its start.
func Events(p []byte) int {
	n := 0
	for len(p) > 0 {
		line, rest, _ := bytes.Cut(p, []byte("\n"))
		if bytes.HasPrefix(line, []byte("data:")) && !bytes.Equal(bytes.TrimSpace(line[5:]), []byte("[DONE]")) {
			n++
		}
		p = rest
	}
	return n
}
