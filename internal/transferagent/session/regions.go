package session

import (
	"errors"
	"fmt"
	"hash/fnv"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kvhandoff/kvhandoff/internal/transferagent/cuda"
	"github.com/kvhandoff/kvhandoff/internal/transferagent/cudaipc"
	"github.com/kvhandoff/kvhandoff/internal/transferagent/fabric"
	agentv1 "github.com/kvhandoff/kvhandoff/transferagent/api/v1"
)

// RegisterRegion maps and registers one of the engine's KV regions: host memory from a
// memfd the engine passed over the memory socket (memory_handle), or GPU memory from an
// allocation passed there (memory_handle) or a legacy CUDA IPC handle.
func (s *Session) RegisterRegion(r *agentv1.RegisterRegionRequest) error {
	switch {
	case r.BlockLen == 0 || r.BlockCount == 0:
		return Invalid("block_len", "and block_count must be positive")
	case r.BlockLen > r.Size/uint64(r.BlockCount):
		return Invalid("size", "%d bytes cannot hold %d blocks of %d bytes", r.Size, r.BlockCount, r.BlockLen)
	}
	switch r.Kind {
	case agentv1.MemoryKind_MEMORY_KIND_HOST:
		return s.registerHostRegion(r)
	case agentv1.MemoryKind_MEMORY_KIND_CUDA, agentv1.MemoryKind_MEMORY_KIND_NEURON:
		if r.Kind == agentv1.MemoryKind_MEMORY_KIND_CUDA && (len(r.CudaIpcHandle) > 0 || r.MemoryHandle != 0) {
			return s.registerGPURegion(r)
		}
		// The dmabuf path needs libfabric's FI_MR_DMABUF at build time and the fd in
		// this process; without either, say so rather than register something else.
		if !fabric.HasDmabuf() {
			return status.Errorf(codes.FailedPrecondition, "kind %s: %v", r.Kind, fabric.ErrNoDmabuf)
		}
		return status.Errorf(codes.Unimplemented, "kind %s: device memory needs its dmabuf fd passed to the agent over the socket, which this "+
			"agent does not accept yet", r.Kind)
	}
	return Invalid("kind", "must be MEMORY_KIND_HOST, _CUDA or _NEURON")
}

func (s *Session) registerHostRegion(r *agentv1.RegisterRegionRequest) error {
	f := s.claim(r.MemoryHandle)
	if f == nil {
		return Invalid("memory_handle", "%d names no memfd this session passed over %s (each handle registers one region)",
			r.MemoryHandle, agentv1.MemorySocketName)
	}
	m, err := mapFD(f, r.Offset, r.Size)
	if err != nil {
		f.Close()
		return status.Error(codes.InvalidArgument, err.Error())
	}
	if err := s.n.memory.claim(s, r.RegionId, m); err != nil {
		f.Close()
		m.unmap()
		return status.Error(codes.AlreadyExists, err.Error())
	}
	if err := s.call(func() error { return s.addRegion(r, m, f) }); err != nil {
		f.Close() // a no-op if addRegion kept it before the session ended
		s.n.memory.release(s, r.RegionId)
		m.unmap()
		return err
	}
	return nil
}

// registerGPURegion checks and opens a CUDA region: of an allocation the engine passed
// over the memory socket (memory_handle), or one it exported as a legacy IPC handle.
func (s *Session) registerGPURegion(r *agentv1.RegisterRegionRequest) error {
	k, ordinal, err := s.gpuAllocation(r)
	if err != nil {
		return err
	}
	gr, err := s.n.gpus.OpenRegion(k, r.Offset, r.Size)
	if err != nil {
		field := "offset"
		if k.Passed == 0 {
			field = "cuda_ipc_handle"
		}
		return Invalid(field, "%v", err)
	}
	// The claim index sees the allocation as a file named by its key: no two regions of
	// any engine may overlap in it.
	f := fnv.New64a()
	fmt.Fprintf(f, "%d/%x", k.Passed, k.Handle)
	m := &mapping{file: fileID{dev: ^uint64(0), ino: f.Sum64()}, off: r.Offset, size: r.Size}
	if err := s.n.memory.claim(s, r.RegionId, m); err != nil {
		s.n.gpus.Close(gr.Key)
		return status.Error(codes.AlreadyExists, err.Error())
	}
	if err := s.call(func() error { return s.addGPURegion(r, m, gr, ordinal) }); err != nil {
		s.n.memory.release(s, r.RegionId)
		s.n.gpus.Close(gr.Key)
		return err
	}
	return nil
}

// gpuAllocation is the allocation a CUDA region names and the GPU that holds it.
func (s *Session) gpuAllocation(r *agentv1.RegisterRegionRequest) (cudaipc.Key, int, error) {
	if len(r.CudaDeviceUuid) != 16 && (len(r.CudaDeviceUuid) != 0 || r.MemoryHandle == 0) {
		return cudaipc.Key{}, 0, Invalid("cuda_device_uuid", "must be the 16 bytes of a cuDeviceGetUuid, got %d", len(r.CudaDeviceUuid))
	}
	if r.MemoryHandle != 0 {
		if len(r.CudaIpcHandle) != 0 {
			return cudaipc.Key{}, 0, Invalid("cuda_ipc_handle", "must be empty with memory_handle")
		}
		p, ok := s.passedAllocation(r.MemoryHandle)
		if !ok {
			return cudaipc.Key{}, 0, Invalid("memory_handle", "%d names no GPU allocation this session passed over %s", r.MemoryHandle, agentv1.MemorySocketName)
		}
		if len(r.CudaDeviceUuid) == 16 {
			if want, err := cuda.DeviceUUID(p.ordinal); err != nil || want != cuda.UUID(r.CudaDeviceUuid) {
				return cudaipc.Key{}, 0, Invalid("cuda_device_uuid", "names another GPU than the one holding the allocation")
			}
		}
		return p.key, p.ordinal, nil
	}
	if len(r.CudaIpcHandle) != 64 {
		return cudaipc.Key{}, 0, Invalid("cuda_ipc_handle", "must be the 64 bytes of a cuIpcGetMemHandle, got %d", len(r.CudaIpcHandle))
	}
	ordinal, err := cuda.DeviceByUUID(cuda.UUID(r.CudaDeviceUuid))
	if errors.Is(err, cuda.ErrNoDriver) {
		return cudaipc.Key{}, 0, status.Errorf(codes.FailedPrecondition, "kind MEMORY_KIND_CUDA: %v (the agent's pod needs NVIDIA_VISIBLE_DEVICES=all "+
			"and the driver's libraries)", err)
	}
	if err != nil {
		return cudaipc.Key{}, 0, Invalid("cuda_device_uuid", "%v", err)
	}
	return cudaipc.Key{Handle: cuda.IPCHandle(r.CudaIpcHandle), GPU: ordinal}, ordinal, nil
}
