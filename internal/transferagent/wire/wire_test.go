package wire

import (
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"reflect"
	"strings"
	"testing"
)

var samples = []Message{
	&Hello{Agent: "ip-10-0-1-7", Epoch: 1764457200123, Nonce: "0123456789abcdef"},
	&Auth{MAC: strings.Repeat("m", 32)},
	&EngineInfo{Engine: "qwen3-32b-decode-0.default/3", Epoch: 9, Address: "fi-address-bytes", Regions: []RegionInfo{
		{ID: 0, BlockLen: 4096, Blocks: 8192, Addr: 0x7f0000000000, Key: 17},
		{ID: 1, BlockLen: 4096, Blocks: 8192, Addr: 0x7f0002000000, Key: 18},
	}},
	&Register{Request: "req-1", Attempt: 2, Engine: "qwen3-32b-decode-0.default/3", EngineEpoch: 7,
		Source: "qwen3-32b-prefill-0.default/3", Token: 41, Blocks: []uint32{0, 1, 2, 4096, 1<<32 - 1}},
	&RegisterTail{Register: Register{Request: "req-1", Attempt: 2, Engine: "d/0", EngineEpoch: 7, Source: "p/0", Token: 41,
		Blocks: []uint32{9, 10}}, First: 3},
	&Heartbeat{Request: "req-1", Attempt: 2, Source: "p/0"},
	&Cancel{Request: "req-1", Attempt: 2, Source: "p/0"},
	&CancelAcked{Request: "req-1", Attempt: 2, Engine: "d/0", Signalled: 1},
	&Failed{Request: "req-1", Attempt: 2, Engine: "d/0", Reason: "lease of 30s expired without a heartbeat"},
	&Acquire{Request: "req-1", Attempt: 1, Engine: "d/0", EngineEpoch: 3, Source: "p/0", Blocks: []uint32{5, 6, 7}},
	&Acquired{Request: "req-1", Attempt: 1, Engine: "d/0", LeaseMillis: 30000},
	&Release{Request: "req-1", Attempt: 1, Source: "p/0", Failed: 0},
	&Decline{Request: "req-1", Source: "p/0"},
	&Abandon{Request: "req-1", Attempt: 2, Engine: "d/0", Source: "p/0"},
	&Signalled{Request: "req-1", Attempt: 2, Engine: "d/0"},
	&Resignal{Request: "req-1", Attempt: 2, Source: "p/0"},
	&Writing{Request: "req-1", Attempt: 2, Engine: "d/0"},
	&Heads{Engine: "qwen3-32b-decode-0.default/3", Epoch: 9, First: 2, Count: 1, HeadBytes: 4096},
	&GPU{Engine: "qwen3-32b-decode-0.default/3", Epoch: 9, Device: strings.Repeat("u", 16), Handles: []string{strings.Repeat("h", 64),
		strings.Repeat("i", 8)}, Offsets: []uint64{0, 1 << 30}}, // an IPC handle, a passed allocation's number
	&Rails{Engine: "qwen3-32b-decode-0.default/3", Epoch: 9, Rails: []Rail{{Address: "fi-address-rail-1", Keys: []uint64{19, 20}}}},
}

// TestHeadsJoinTheirEngineInfo: a Heads message completes the EngineInfo of its engine
// and epoch only when its heads fill every region's blocks exactly.
func TestHeadsJoinTheirEngineInfo(t *testing.T) {
	info, heads := samples[2].(*EngineInfo), samples[len(samples)-3].(*Heads)
	if got, err := info.WithHeads(heads); err != nil || got.Heads != heads || info.Heads != nil {
		t.Fatalf("WithHeads: %v", err)
	}
	for name, bad := range map[string]Heads{
		"another epoch":          {Engine: heads.Engine, Epoch: 8, First: 2, Count: 1, HeadBytes: 4096},
		"heads short of a block": {Engine: heads.Engine, Epoch: 9, First: 2, Count: 1, HeadBytes: 2048},
		"heads beyond a block":   {Engine: heads.Engine, Epoch: 9, First: 2, Count: 2, HeadBytes: 4096},
		"no heads":               {Engine: heads.Engine, Epoch: 9, First: 2, Count: 0, HeadBytes: 4096},
		"an absurd first head":   {Engine: heads.Engine, Epoch: 9, First: 1 << 40, Count: 1, HeadBytes: 4096},
	} {
		if _, err := info.WithHeads(&bad); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
}

// TestGPUMemoryJoinsItsEngineInfo: a GPU message completes the EngineInfo of its engine
// and epoch; off the node it carries no handles; one with a handle per region missing, or
// a handle of neither an IPC handle's length nor a passed allocation number's, is refused.
func TestGPUMemoryJoinsItsEngineInfo(t *testing.T) {
	info, gpu := samples[2].(*EngineInfo), samples[len(samples)-2].(*GPU)
	got, err := info.WithGPU(gpu)
	if err != nil || got.GPU != gpu || info.GPU != nil {
		t.Fatalf("WithGPU: %v", err)
	}
	remote := *gpu
	remote.Handles, remote.Offsets = nil, nil
	if _, err := info.WithGPU(&remote); err != nil {
		t.Fatalf("GPU memory described without handles (to another node): %v", err)
	}
	for name, bad := range map[string]GPU{
		"another epoch":     {Engine: gpu.Engine, Epoch: 8, Device: gpu.Device},
		"a short device id": {Engine: gpu.Engine, Epoch: gpu.Epoch, Device: "u"},
		"a handle missing":  {Engine: gpu.Engine, Epoch: gpu.Epoch, Device: gpu.Device, Handles: gpu.Handles[:1], Offsets: gpu.Offsets[:1]},
		"a 7-byte handle": {Engine: gpu.Engine, Epoch: gpu.Epoch, Device: gpu.Device, Handles: []string{gpu.Handles[0],
			gpu.Handles[1][1:]}, Offsets: gpu.Offsets},
		"an offset missing": {Engine: gpu.Engine, Epoch: gpu.Epoch, Device: gpu.Device, Handles: gpu.Handles, Offsets: gpu.Offsets[:1]},
	} {
		if _, err := info.WithGPU(&bad); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
}

// TestRailsJoinTheirEngineInfo: a Rails message completes the EngineInfo of its engine
// and epoch, rail by rail; one of another incarnation, or with a key per region missing,
// is refused.
func TestRailsJoinTheirEngineInfo(t *testing.T) {
	info, rails := samples[2].(*EngineInfo), samples[len(samples)-1].(*Rails)
	got, err := info.WithRails(rails)
	if err != nil {
		t.Fatal(err)
	}
	if a := got.Addresses(); len(a) != 2 || string(a[0]) != info.Address || string(a[1]) != "fi-address-rail-1" {
		t.Fatalf("addresses %q", a)
	}
	if k := got.Keys(1); !reflect.DeepEqual(k, []uint64{18, 20}) {
		t.Fatalf("region 1's keys %v, want [18 20]", k)
	}
	if info.Rails != nil {
		t.Fatal("WithRails changed the EngineInfo it was given")
	}
	stale := *rails
	stale.Epoch = 8
	if _, err := info.WithRails(&stale); err == nil {
		t.Fatal("rails of another epoch were accepted")
	}
	short := Rails{Engine: rails.Engine, Epoch: rails.Epoch, Rails: []Rail{{Address: "x", Keys: []uint64{19}}}}
	if _, err := info.WithRails(&short); err == nil || !strings.Contains(err.Error(), "1 region keys for 2 regions") {
		t.Fatalf("a rail with a missing key: %v", err)
	}
}

func TestRoundTripOverAStream(t *testing.T) {
	var stream []byte
	for _, m := range samples {
		var err error
		if stream, err = Encode(stream, m); err != nil {
			t.Fatal(err)
		}
	}
	r := bytes.NewReader(stream)
	for _, want := range samples {
		got, err := Read(r)
		if err != nil {
			t.Fatal(err)
		}
		if !reflect.DeepEqual(got, want) {
			t.Fatalf("got %#v, want %#v", got, want)
		}
	}
	if _, err := Read(r); err != io.EOF {
		t.Fatalf("after the last frame: %v", err)
	}
}

func frame(body ...byte) []byte {
	return append(binary.BigEndian.AppendUint32(nil, uint32(len(body))), body...)
}

func cat(parts ...[]byte) []byte { return bytes.Join(parts, nil) }

func TestMalformedFramesAreRefused(t *testing.T) {
	good, _ := Encode(nil, &Heartbeat{Request: "r", Attempt: 1, Source: "s"})
	uv := func(v uint64) []byte { return binary.AppendUvarint(nil, v) }
	bodies := map[string][]byte{
		"empty body":              {},
		"another version":         {2, byte(KindHeartbeat), 1, 'r', 1, 1, 's'},
		"unknown kind":            {Version, 99},
		"trailing bytes":          cat(good[4:], []byte{0}),
		"string past the end":     {Version, byte(KindCancel), 10, 'a'},
		"string over the limit":   cat([]byte{Version, byte(KindCancel)}, uv(MaxString+1)),
		"bad varint":              {Version, byte(KindHeartbeat), 1, 'r', 0xff},
		"more blocks than bytes":  {Version, byte(KindRegister), 1, 'r', 1, 1, 'e', 1, 1, 's', 1, 100, 1},
		"block id over 32 bits":   cat([]byte{Version, byte(KindRegister), 1, 'r', 1, 1, 'e', 1, 1, 's', 1, 1}, uv(1<<33)),
		"more rails than allowed": cat([]byte{Version, byte(KindRails), 1, 'e', 1}, uv(MaxRails), bytes.Repeat([]byte{0, 0}, MaxRails)),
		"more keys than bytes":    {Version, byte(KindRails), 1, 'e', 1, 1, 1, 'a', 50, 1},
		"more regions than bytes": cat([]byte{Version, byte(KindEngineInfo), 1, 'e', 1, 1, 'a'}, uv(MaxRegions), []byte{1, 2, 3, 4, 5}),
	}
	for name, body := range bodies {
		if _, err := Read(bytes.NewReader(frame(body...))); !errors.Is(err, ErrMalformed) {
			t.Errorf("%s: %v, want ErrMalformed", name, err)
		}
	}
	// A length over the limit is refused before anything is read or allocated.
	if _, err := Read(bytes.NewReader(binary.BigEndian.AppendUint32(nil, MaxFrame+1))); !errors.Is(err, ErrMalformed) {
		t.Errorf("oversized length: %v", err)
	}
	if _, err := Read(bytes.NewReader(good[:len(good)-1])); err == nil {
		t.Error("truncated frame accepted")
	}
}

func TestEncodeRefusesWhatDecodeWouldRefuse(t *testing.T) {
	if _, err := Encode(nil, &Failed{Request: "r", Reason: strings.Repeat("x", MaxString+1)}); err == nil {
		t.Error("encoded an over-long string")
	}
	if _, err := Encode(nil, &Register{Request: "r", Blocks: make([]uint32, MaxBlocks+1)}); err == nil {
		t.Error("encoded too many blocks")
	}
}

// FuzzDecode feeds arbitrary bodies to the decoder: it must never panic, and whatever it
// accepts must encode and decode back to the same message.
func FuzzDecode(f *testing.F) {
	for _, m := range samples {
		b, _ := Encode(nil, m)
		f.Add(b[4:])
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		m, err := Decode(body)
		if err != nil {
			return
		}
		b, err := Encode(nil, m)
		if err != nil {
			t.Fatalf("decoded %#v but cannot encode it: %v", m, err)
		}
		again, err := Decode(b[4:])
		if err != nil || !reflect.DeepEqual(again, m) {
			t.Fatalf("round trip of %#v: %#v, %v", m, again, err)
		}
	})
}
