package writer

import (
	"bytes"
	"testing"
	"time"

	"github.com/kvhandoff/kvhandoff/internal/transferagent/fabric"
	"github.com/kvhandoff/kvhandoff/internal/transferagent/rendezvous"
)

// memCopier is a Copier over one host buffer, addresses being offsets into it: what the
// agent's CUDA copier does on a GPU (tested there, make test-gpu), here to check the
// writer's side of the contract in every run. Copies complete on the Poll after the one
// they were queued before, as a stream's do some time after queueing.
type memCopier struct {
	mem     []byte
	queued  []fabric.Completion
	running []fabric.Completion
}

func (c *memCopier) Copy(dst, src, n, id uint64) error {
	copy(c.mem[dst:dst+n], c.mem[src:src+n])
	c.queued = append(c.queued, fabric.Completion{ID: id})
	return nil
}

func (c *memCopier) Reap(done []fabric.Completion) []fabric.Completion {
	done = append(done, c.running...)
	c.running, c.queued = c.queued, nil
	return done
}

// TestADestinationOfCopiesIsWrittenByTheCopierAndNotified: a same-node destination (one
// with Notify) gets the planned writes as copies, and its signal by Notify only after
// every copy completed — never through the fabric.
func TestADestinationOfCopiesIsWrittenByTheCopierAndNotified(t *testing.T) {
	const region = blockLen * nBlocks
	c := &memCopier{mem: make([]byte, 2*nRegions*region)} // sources, then destinations
	for i := range nRegions * region {
		c.mem[i] = byte(i*7 + i>>12)
	}
	ep, err := fabric.Open("tcp;ofi_rxm") // the writer's endpoint, which must stay unused
	if err != nil {
		t.Fatal(err)
	}
	defer ep.Close()
	table := rendezvous.New(rendezvous.Config{Lease: time.Hour, RegistrationTimeout: time.Hour, Regions: nRegions})
	var layout []Region
	src := map[int]uint64{}
	var notified []uint64
	dest := Destination{Notify: func(data uint64) error { notified = append(notified, data); return nil }}
	for id := range nRegions {
		layout = append(layout, Region{ID: id, BlockLen: blockLen, Blocks: nBlocks})
		src[id] = uint64(id * region)
		dest.Regions = append(dest.Regions, RemoteRegion{Region: layout[id], Addr: uint64((nRegions + id) * region)})
	}
	w := New(ep, table, nil, layout)
	w.UseCopier(c, src)
	w.AddDestination(decode, dest)

	blocksSrc, blocksDst := seq(0, 32), seq(200, 32)
	acts := mustActs(t)(table.Register(time.Now(), rendezvous.Registration{Request: "r", Attempt: 1, Decode: decode, Blocks: blocksDst}))
	acts = append(acts, mustActs(t)(table.SourceReady(time.Now(), rendezvous.Part{Request: "r", Blocks: blocksSrc, Final: true}))...)
	for _, a := range acts {
		if tr, ok := a.(rendezvous.Transfer); ok {
			if _, _, err := w.Submit(tr); err != nil {
				t.Fatal(err)
			}
		}
	}
	delivered := false
	for i := 0; !delivered && i < 100; i++ {
		got, failed, err := w.Poll(time.Now())
		if err != nil || len(failed) > 0 {
			t.Fatal(err, failed)
		}
		for _, a := range got {
			_, delivered = a.(rendezvous.Delivered)
		}
	}
	if !delivered {
		t.Fatal("never delivered")
	}
	if len(notified) != 0 {
		t.Fatal("notified before the writer was told to signal")
	}
	if err := w.Signal(decode, 41); err != nil {
		t.Fatal(err)
	}
	if len(notified) != 1 || notified[0] != 41 {
		t.Fatalf("notified %v, want [41]", notified)
	}
	if w.Stats.Writes != nRegions {
		t.Errorf("%d copies, want one per region (contiguous blocks)", w.Stats.Writes)
	}
	for id := range nRegions {
		from := c.mem[id*region : id*region+32*blockLen]
		to := c.mem[(nRegions+id)*region+200*blockLen : (nRegions+id)*region+232*blockLen]
		if !bytes.Equal(from, to) {
			t.Fatalf("region %d: the destination blocks are not the source's", id)
		}
	}
	if sent := ep.RailBytes(); sent[0] != 0 {
		t.Fatalf("the fabric carried %d bytes for a destination of copies", sent[0])
	}
}
