package kvevents

import (
	"encoding/binary"
	"fmt"
)

// maxDepth bounds how deep a payload's arrays and maps nest. vLLM's batch nests about 6
// deep (batch, events, event, extra_keys, a key, its tuple); the msgpack decoder
// recurses once a level, and a 6 MB payload of nested arrays overflowed its stack.
const maxDepth = 32

// checkDepth walks a msgpack payload without recursing and refuses one that nests past
// maxDepth, is cut short, or holds a type code msgpack does not have.
func checkDepth(b []byte) error {
	// left[i] is how many items the i-th open container still holds.
	left := []uint64{1}
	for len(left) > 0 {
		if left[len(left)-1] == 0 {
			left = left[:len(left)-1]
			continue
		}
		left[len(left)-1]--
		if len(b) == 0 {
			return fmt.Errorf("a msgpack value cut short")
		}
		c := b[0]
		b = b[1:]
		skip, items, container, err := item(c, &b)
		if err != nil {
			return err
		}
		if skip > uint64(len(b)) {
			return fmt.Errorf("a msgpack value cut short")
		}
		b = b[skip:]
		if container {
			if len(left) == maxDepth {
				return fmt.Errorf("msgpack nested more than %d deep", maxDepth)
			}
			// A claimed length past the bytes left cannot hold (each item is a byte at least).
			if items > uint64(len(b)) {
				return fmt.Errorf("a msgpack container of %d items in %d bytes", items, len(b))
			}
			left = append(left, items)
		}
	}
	if len(b) != 0 {
		return fmt.Errorf("%d bytes after the msgpack value", len(b))
	}
	return nil
}

// item reads what follows msgpack type code c off *b: how many bytes of the value to
// skip, or the items of a container it opens.
func item(c byte, b *[]byte) (skip, items uint64, container bool, err error) {
	var n uint64
	switch {
	case c <= 0x7f || c >= 0xe0 || c == 0xc0 || c == 0xc2 || c == 0xc3: // fixint, nil, bool
	case c >= 0x80 && c <= 0x8f:
		return 0, 2 * uint64(c&0x0f), true, nil
	case c >= 0x90 && c <= 0x9f:
		return 0, uint64(c & 0x0f), true, nil
	case c >= 0xa0 && c <= 0xbf:
		skip = uint64(c & 0x1f)
	case c == 0xc4 || c == 0xd9: // bin8, str8
		skip, err = length(b, 1)
	case c == 0xc5 || c == 0xda:
		skip, err = length(b, 2)
	case c == 0xc6 || c == 0xdb:
		skip, err = length(b, 4)
	case c == 0xc7 || c == 0xc8 || c == 0xc9: // ext8/16/32: length, type, data
		n, err = length(b, 1<<(c-0xc7))
		skip = n + 1
	case c == 0xca, c == 0xce, c == 0xd2:
		skip = 4
	case c == 0xcb, c == 0xcf, c == 0xd3:
		skip = 8
	case c == 0xcc, c == 0xd0:
		skip = 1
	case c == 0xcd, c == 0xd1:
		skip = 2
	case c >= 0xd4 && c <= 0xd8: // fixext 1, 2, 4, 8, 16: type and data
		skip = 1 + 1<<(c-0xd4)
	case c == 0xdc || c == 0xdd:
		n, err = length(b, 2<<(c-0xdc))
		return 0, n, true, err
	case c == 0xde || c == 0xdf:
		n, err = length(b, 2<<(c-0xde))
		return 0, 2 * n, true, err
	default:
		return 0, 0, false, fmt.Errorf("msgpack type code %#x", c)
	}
	return skip, 0, false, err
}

// length reads a big-endian length of n bytes off *b.
func length(b *[]byte, n int) (uint64, error) {
	if len(*b) < n {
		return 0, fmt.Errorf("a msgpack length cut short")
	}
	var v uint64
	switch n {
	case 1:
		v = uint64((*b)[0])
	case 2:
		v = uint64(binary.BigEndian.Uint16(*b))
	case 4:
		v = uint64(binary.BigEndian.Uint32(*b))
	}
	*b = (*b)[n:]
	return v, nil
}
