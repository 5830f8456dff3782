package kvevents

import (
	"encoding/binary"
	"runtime"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/vmihailenco/msgpack/v5"
)

// storeMessage is vLLM's message for one prompt of blocks×blockSize tokens stored from
// its root, as 0.32–0.34 encode it (an array batch, a map event).
func storeMessage(b *testing.B, seq uint64, first, blocks, blockSize int) [][]byte {
	hs := make([]uint64, blocks)
	for i := range hs {
		hs[i] = uint64(first+i) * 0x9e3779b97f4a7c15
	}
	ids := make([]uint32, blocks*blockSize)
	for i := range ids {
		ids[i] = uint32(i % 50000)
	}
	payload, err := msgpack.Marshal([]any{1.5, []any{map[string]any{"type": KindStored, "block_hashes": hs, "parent_block_hash": nil,
		"token_ids": ids, "block_size": blockSize, "lora_id": nil, "medium": "GPU", "lora_name": nil, "group_idx": 0,
		"kv_cache_spec_kind": fullAttnKind}}, 0})
	if err != nil {
		b.Fatal(err)
	}
	return [][]byte{[]byte("kv"), binary.BigEndian.AppendUint64(nil, seq), payload}
}

// BenchmarkStore16k is the sidecar's work for a 16k-token prompt stored (1,024 blocks of
// 16): decoding vLLM's message, keying the blocks and framing them for followers, then
// evicting them one event a block as vLLM does. Reported: bytes held a block.
func BenchmarkStore16k(b *testing.B) {
	const blocks, blockSize = 1024, 16
	hub := NewServer(NewKeys("m", 1<<22), prometheus.NewRegistry())
	msgs := make([][][]byte, 64)
	for i := range msgs {
		msgs[i] = storeMessage(b, 0, i*blocks, blocks, blockSize)
	}
	b.SetBytes(int64(len(msgs[0][2])))
	b.ResetTimer()
	for i := range b.N {
		batch, err := DecodeMessage(msgs[i%len(msgs)])
		if err != nil {
			b.Fatal(err)
		}
		batch.Seq = uint64(2 * i)
		hub.Apply(batch)
		removed := Batch{Seq: uint64(2*i + 1)}
		for _, h := range batch.Events[0].Hashes {
			removed.Events = append(removed.Events, Event{Kind: KindRemoved, Hashes: []string{h}, Medium: "GPU"})
		}
		hub.Apply(removed)
	}
	b.StopTimer()
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	k := NewKeys("m", 1<<22)
	for i := range 64 {
		batch, _ := DecodeMessage(storeMessage(b, 0, i*blocks, blocks, blockSize))
		k.Apply(batch.Events[0])
	}
	runtime.GC()
	runtime.ReadMemStats(&after)
	b.ReportMetric(float64(after.HeapAlloc-before.HeapAlloc)/float64(k.Len()), "B/block-held")
	runtime.KeepAlive(k)
}
