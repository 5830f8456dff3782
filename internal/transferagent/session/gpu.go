package session

import (
	"encoding/binary"
	"errors"
	"fmt"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kvhandoff/kvhandoff/internal/transferagent/cuda"
	"github.com/kvhandoff/kvhandoff/internal/transferagent/cudaipc"
	"github.com/kvhandoff/kvhandoff/internal/transferagent/mesh"
	"github.com/kvhandoff/kvhandoff/internal/transferagent/wire"
	"github.com/kvhandoff/kvhandoff/internal/transferagent/writer"
	agentv1 "github.com/kvhandoff/kvhandoff/transferagent/api/v1"
)

// sessionGPU is a session whose regions are GPU memory: the GPU they are on,
// and the stream the rank's copies run on (made with its first region).
type sessionGPU struct {
	ordinal int
	uuid    cuda.UUID
	copier  *cudaipc.Copier
}

// addGPURegion adds an opened GPU region: a rank's regions are all host memory or all on
// one GPU.
func (s *Session) addGPURegion(r *agentv1.RegisterRegionRequest, m *mapping, gr *cudaipc.Region, ordinal int) error {
	if s.frozen {
		return status.Error(codes.FailedPrecondition, "region_id: regions are fixed once the engine's first transfer started")
	}
	if (s.gpu == nil && len(s.regions) > 0) || (s.gpu != nil && s.gpu.ordinal != ordinal) {
		return status.Error(codes.FailedPrecondition, "kind: an engine rank's regions must all be host memory or all on one GPU")
	}
	if s.gpu == nil {
		c, err := s.n.gpus.Context(ordinal)
		if err != nil {
			return status.Errorf(codes.Internal, "GPU %d: %v", ordinal, err)
		}
		uuid, err := cuda.DeviceUUID(ordinal)
		if err != nil {
			return status.Errorf(codes.Internal, "GPU %d: %v", ordinal, err)
		}
		cp, err := cudaipc.NewCopier(c)
		if err != nil {
			return status.Errorf(codes.Internal, "a CUDA stream for the rank's copies: %v", err)
		}
		s.gpu = &sessionGPU{ordinal: ordinal, uuid: uuid, copier: cp}
	}
	s.track(r, &localRegion{id: r.RegionId, m: m, dev: gr, blockLen: r.BlockLen, blocks: r.BlockCount})
	return nil
}

// devices are the rank's regions' device addresses by region ID.
func (s *Session) devices() map[int]uint64 {
	out := make(map[int]uint64, len(s.regions))
	for id, r := range s.regions {
		out[int(id)] = uint64(r.dev.Ptr)
	}
	return out
}

// gpuInfo describes the rank's GPU memory to a peer: with the allocations' keys to a peer
// within this agent, without them to any other (they name allocations in this process).
func (s *Session) gpuInfo(local bool) *wire.GPU {
	g := &wire.GPU{Engine: s.key, Epoch: s.epoch, Device: string(s.gpu.uuid[:])}
	if local {
		for _, l := range s.layout {
			r := s.regions[uint32(l.ID)]
			g.Handles = append(g.Handles, wireKey(r.dev.Key))
			g.Offsets = append(g.Offsets, r.dev.Off)
		}
	}
	return g
}

// wireKey and keyOf write an allocation's key in wire.GPU's Handles: an IPC handle's 64
// bytes, or a passed allocation's number in 8.
func wireKey(k cudaipc.Key) string {
	if k.Passed != 0 {
		return string(binary.LittleEndian.AppendUint64(nil, k.Passed))
	}
	return string(k.Handle[:])
}

func keyOf(h string, ordinal int) cudaipc.Key {
	if len(h) == 8 {
		return cudaipc.Key{Passed: binary.LittleEndian.Uint64([]byte(h))}
	}
	return cudaipc.Key{Handle: cuda.IPCHandle([]byte(h)), GPU: ordinal}
}

// openPeerGPU opens a peer engine's GPU regions in this rank's GPU context, making r's
// addresses device addresses there. Pairs of host and GPU memory, and GPU memory off this
// node, are refused.
func (s *Session) openPeerGPU(p *mesh.Peer, info *wire.EngineInfo, r *remoteEngine) error {
	switch {
	case info.GPU == nil || s.gpu == nil:
		return errors.New("one engine's KV is in GPU memory and the other's in host memory: such pairs are not supported")
	case !p.Local() || len(info.GPU.Handles) == 0:
		return errors.New("its KV is in GPU memory on another node; moving GPU memory between nodes needs the EFA dmabuf path, which this agent does not have")
	}
	for i, reg := range r.regions {
		gr, err := s.n.gpus.OpenRegion(keyOf(info.GPU.Handles[i], s.gpu.ordinal), info.GPU.Offsets[i], reg.BlockLen*uint64(reg.Blocks))
		if err != nil {
			s.release(r)
			return fmt.Errorf("region %d: %w", reg.ID, err)
		}
		r.opened = append(r.opened, gr.Key)
		r.byID[reg.ID] = writer.RemoteRegion{Region: reg, Addr: uint64(gr.Ptr)}
	}
	r.onGPU = true
	return nil
}

// release closes the GPU allocations a peer engine's memory held open here.
func (s *Session) release(r *remoteEngine) {
	for _, k := range r.opened {
		s.n.gpus.Close(k)
	}
	r.opened = nil
}

// closeGPU waits for the rank's copies and closes what it opened (teardown).
func (s *Session) closeGPU() {
	if s.gpu == nil {
		return
	}
	s.gpu.copier.Close()
	for _, r := range s.retired {
		s.release(r)
	}
	for _, r := range s.remotes {
		s.release(r)
	}
	for _, r := range s.regions {
		s.n.gpus.Close(r.dev.Key)
	}
}
