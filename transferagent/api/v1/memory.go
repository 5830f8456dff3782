package agentv1

import (
	"path/filepath"
	"strconv"
	"strings"
)

// The memory socket carries what gRPC cannot: file descriptors. An engine hands the agent
// its host KV memory as a memfd sealed against shrinking, so the agent maps memory the
// engine owns (no copy) and no engine can truncate it under the agent's mapping.
//
// The socket is MemorySocketName in the engine socket's folder, of type SOCK_SEQPACKET.
// One request is one packet: the session id (RegisterEngineResponse.session) as its
// bytes, with exactly one fd in SCM_RIGHTS. The answer is one packet: "ok <handle>",
// where handle is what RegisterRegionRequest.memory_handle names, or "error <reason>".
// A handle is good for one RegisterRegion of that session; fds that no region claims are
// closed when the session ends.
//
// GPU memory is passed the same way, for engine pairs on one node: the packet's bytes are
// CUDAPrefix, the session id, a space and the allocation's size in bytes, with the fd
// cuMemExportToShareableHandle made for it (CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR).
// The agent maps the allocation at once; the driver refuses a size beyond it. The handle
// answered is good for any number of RegisterRegions (kind MEMORY_KIND_CUDA) of that
// session, each a part of the allocation; the agent unmaps it when the session ends. No
// process needs another's PID namespace, as legacy CUDA IPC handles do.
//
// A doorbell (package transferagent/doorbell) is passed the same way: the packet's bytes
// are DoorbellPrefix and the session id, with the doorbell memfd alone. The answer is
// "error <reason>", or "ok 0" with two bells in SCM_RIGHTS (one end of each of two Unix
// stream socket pairs the agent made): the one the engine rings after writing reports,
// then the one the agent rings after writing events (an engine that polls its events ring
// may close it). A session has at most one
// doorbell.
const MemorySocketName = "memory.sock"

// CUDAPrefix starts a memory socket packet that passes a GPU allocation.
const CUDAPrefix = "cuda "

// DoorbellPrefix starts a memory socket packet that passes a doorbell.
const DoorbellPrefix = "doorbell "

// MemorySocket is the memory socket beside an agent's engine socket.
func MemorySocket(engineSocket string) string {
	return filepath.Join(filepath.Dir(engineSocket), MemorySocketName)
}

// ParseMemoryAnswer reads the memory socket's answer.
func ParseMemoryAnswer(b []byte) (uint64, error) {
	s := string(b)
	if h, ok := strings.CutPrefix(s, "ok "); ok {
		return strconv.ParseUint(h, 10, 64)
	}
	if reason, ok := strings.CutPrefix(s, "error "); ok {
		return 0, memoryError(reason)
	}
	return 0, memoryError("malformed answer " + strconv.Quote(s))
}

type memoryError string

func (e memoryError) Error() string { return "memory socket: " + string(e) }
