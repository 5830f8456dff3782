// Package keystream is the protocol between an engine pod's kv-events sidecar and the
// routers and endpoint pickers that follow it: the keys of the KV blocks the engine holds,
// as frames over one long HTTP response, and the pool's token that a follower presents.
// Both ends import it; neither end's other code does.
package keystream

import (
	"bufio"
	"encoding/binary"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"github.com/kvhandoff/kvhandoff/internal/router/prefix"
)

// The stream a sidecar serves at GET StreamPath is frames of one op byte, a 4-byte
// big-endian count and that many 8-byte big-endian keys. It starts with OpSnapshot and
// the keys held (OpAdd), then relays changes; an OpAdd of no key is a heartbeat.
const (
	StreamPath = "/v1/kv-keys"
	// OpSnapshot: forget what this stream said; what is held follows.
	OpSnapshot = 'S'
	// OpAdd: the engine holds these keys, each chain's from its first block on.
	OpAdd = 'A'
	// OpRemove: the engine evicted these.
	OpRemove = 'R'
	// OpEmptied: the engine dropped everything (it restarted, or cleared its cache):
	// what any source says it held is gone.
	OpEmptied = 'E'

	// Heartbeat is how often an idle stream says it is alive; a follower gives up on a
	// stream silent for 3 of them.
	Heartbeat = 10 * time.Second
	// MaxFrameKeys bounds a frame: a follower refuses larger ones, a snapshot is split.
	MaxFrameKeys = 1 << 16
)

// AppendFrame appends a frame of op and keys to b.
func AppendFrame(b []byte, op byte, keys []prefix.Key) []byte {
	b = append(b, op)
	b = binary.BigEndian.AppendUint32(b, uint32(len(keys)))
	for _, k := range keys {
		b = binary.BigEndian.AppendUint64(b, uint64(k))
	}
	return b
}

// ReadFrame reads one frame into keys (reused).
func ReadFrame(r *bufio.Reader, keys []prefix.Key) (byte, []prefix.Key, error) {
	var head [5]byte
	if _, err := io.ReadFull(r, head[:]); err != nil {
		return 0, nil, err
	}
	op, n := head[0], binary.BigEndian.Uint32(head[1:])
	switch op {
	case OpSnapshot, OpAdd, OpRemove, OpEmptied:
	default:
		return 0, nil, fmt.Errorf("a frame of op %q: must be S, A, R or E", op)
	}
	if n > MaxFrameKeys {
		return 0, nil, fmt.Errorf("a frame of %d keys: at most %d", n, MaxFrameKeys)
	}
	keys = keys[:0]
	var k [8]byte
	for range n {
		if _, err := io.ReadFull(r, k[:]); err != nil {
			return 0, nil, err
		}
		keys = append(keys, prefix.Key(binary.BigEndian.Uint64(k[:])))
	}
	return op, keys, nil
}

// minToken is the shortest token accepted: the manager makes 64 hex characters.
const minToken = 32

// ReadToken reads a token file (a mounted Secret's key), refusing one too short to be a
// secret.
func ReadToken(path string) (string, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return "", err
	}
	t := strings.TrimSpace(string(b))
	if len(t) < minToken {
		return "", fmt.Errorf("the token in %s is %d characters: at least %d", path, len(t), minToken)
	}
	return t, nil
}
