package doorbell

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"testing"
)

func newMem(t *testing.T) []byte {
	t.Helper()
	mem := make([]byte, Size(MinCapacity))
	if err := Init(mem, MinCapacity); err != nil {
		t.Fatal(err)
	}
	if c, err := Capacity(mem); err != nil || c != MinCapacity {
		t.Fatalf("Capacity = %d, %v", c, err)
	}
	return mem
}

func drainAll(t *testing.T, r *Ring) [][]byte {
	t.Helper()
	var got [][]byte
	if _, err := r.Drain(func(_ Kind, m []byte) error { got = append(got, m); return nil }); err != nil {
		t.Fatal(err)
	}
	return got
}

// Records of every size come out as they went in, in order, across many wraps of the
// ring, and a full ring refuses a record until the consumer frees room.
func TestRecordsCrossTheRingsEndInOrder(t *testing.T) {
	mem := newMem(t)
	prod, cons := Submit(mem, MinCapacity), Submit(mem, MinCapacity)
	next, want := 0, 0
	msg := func(i int) []byte { return bytes.Repeat([]byte{byte(i)}, 1+(i*7919)%5000) }
	for round := 0; round < 200; round++ {
		for {
			err := prod.Put(KindSourceReady, msg(next))
			if errors.Is(err, ErrFull) {
				break
			}
			if err != nil {
				t.Fatal(err)
			}
			next++
		}
		for _, m := range drainAll(t, cons) {
			if !bytes.Equal(m, msg(want)) {
				t.Fatalf("record %d: %d bytes, want %d", want, len(m), len(msg(want)))
			}
			want++
		}
	}
	if want != next || next < 200*MinCapacity/5000 {
		t.Fatalf("%d records out of %d put", want, next)
	}
}

// Each record keeps its kind.
func TestRecordsKeepTheirKinds(t *testing.T) {
	mem := newMem(t)
	r := Submit(mem, MinCapacity)
	for _, k := range []Kind{KindPull, KindSourceReady, KindPull} {
		if err := r.Put(k, []byte{byte(k)}); err != nil {
			t.Fatal(err)
		}
	}
	var kinds []Kind
	if _, err := Submit(mem, MinCapacity).Drain(func(k Kind, m []byte) error {
		if m[0] != byte(k) {
			t.Errorf("a record of kind %d holds %v", k, m)
		}
		kinds = append(kinds, k)
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	if fmt.Sprint(kinds) != fmt.Sprint([]Kind{KindPull, KindSourceReady, KindPull}) {
		t.Fatalf("kinds %v", kinds)
	}
}

// The two rings of one memfd are independent.
func TestTheTwoRingsAreApart(t *testing.T) {
	mem := newMem(t)
	if err := Submit(mem, MinCapacity).Put(KindSourceReady, []byte("to the agent")); err != nil {
		t.Fatal(err)
	}
	if err := Events(mem, MinCapacity).Put(KindEvent, []byte("to the engine")); err != nil {
		t.Fatal(err)
	}
	if got := drainAll(t, Events(mem, MinCapacity)); len(got) != 1 || string(got[0]) != "to the engine" {
		t.Fatalf("events ring held %q", got)
	}
	if got := drainAll(t, Submit(mem, MinCapacity)); len(got) != 1 || string(got[0]) != "to the agent" {
		t.Fatalf("submit ring held %q", got)
	}
}

// A hostile producer or consumer can write anything into the shared words; the side that
// reads them finds out and says so, without reading outside the ring.
func TestAHostileSideIsCaught(t *testing.T) {
	le := binary.LittleEndian
	for _, tc := range []struct {
		name string
		mess func(mem []byte)
	}{
		{"tail past the capacity", func(mem []byte) { le.PutUint64(mem[offSubmitTail:], MinCapacity+8) }},
		{"tail behind the head", func(mem []byte) { le.PutUint64(mem[offSubmitTail:], ^uint64(7)) }},
		{"a zero length", func(mem []byte) { le.PutUint64(mem[offSubmitTail:], 16) }},
		{"a length past the tail", func(mem []byte) {
			le.PutUint32(mem[HeaderSize:], 100)
			le.PutUint64(mem[offSubmitTail:], 16)
		}},
		{"a length past MaxRecord", func(mem []byte) {
			le.PutUint32(mem[HeaderSize:], MaxRecord+1)
			le.PutUint64(mem[offSubmitTail:], MinCapacity)
		}},
		{"a wrap past the tail", func(mem []byte) {
			le.PutUint32(mem[HeaderSize:], wrapMark)
			le.PutUint64(mem[offSubmitTail:], 8)
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			mem := newMem(t)
			tc.mess(mem)
			n, err := Submit(mem, MinCapacity).Drain(func(Kind, []byte) error { return fmt.Errorf("no record should be read") })
			if !errors.Is(err, ErrCorrupt) || n != 0 {
				t.Fatalf("Drain = %d, %v; want ErrCorrupt", n, err)
			}
		})
	}
	t.Run("head past the tail", func(t *testing.T) {
		mem := newMem(t)
		le.PutUint64(mem[offEventsHead:], 4096)
		if err := Events(mem, MinCapacity).Put(KindEvent, []byte("x")); !errors.Is(err, ErrCorrupt) {
			t.Fatalf("Put = %v; want ErrCorrupt", err)
		}
	})
}

func TestAHeaderThatBreaksTheLayoutIsRefused(t *testing.T) {
	mem := newMem(t)
	le := binary.LittleEndian
	le.PutUint64(mem[offCapacity:], MinCapacity+8)
	if _, err := Capacity(mem); err == nil {
		t.Fatal("a capacity that is no power of two was taken")
	}
	le.PutUint64(mem[offCapacity:], 2*MinCapacity)
	if _, err := Capacity(mem); err == nil {
		t.Fatal("a capacity larger than the memfd was taken")
	}
	le.PutUint64(mem[offMagic:], 1)
	if _, err := Capacity(mem); err == nil {
		t.Fatal("a wrong magic was taken")
	}
}
