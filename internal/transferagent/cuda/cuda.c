// C side of package cuda: the driver API through function pointers that kvh_cu_load
// resolves from libcuda.so.1 at run time, so nothing links against CUDA.
#include "cuda.h"
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

// The batch copy takes the Go side's uint64 arrays as CUdeviceptr and size_t arrays.
_Static_assert(sizeof(kvh_CUdeviceptr) == sizeof(uint64_t) && sizeof(size_t) == sizeof(uint64_t), "64-bit pointers and sizes");
_Static_assert(sizeof(kvh_CUmemcpyAttributes) == 24, "CUmemcpyAttributes is 24 bytes");
_Static_assert(sizeof(kvh_CUmemAllocationProp) == 32, "CUmemAllocationProp is 32 bytes");
_Static_assert(sizeof(kvh_CUmemAccessDesc) == 12, "CUmemAccessDesc is 12 bytes");

static struct {
	int (*init)(unsigned int);
	int (*get_error_string)(int, const char **);
	int (*device_get_count)(int *);
	int (*device_get)(kvh_CUdevice *, int);
	int (*primary_ctx_retain)(kvh_CUcontext *, kvh_CUdevice);
	int (*primary_ctx_release)(kvh_CUdevice);
	int (*ctx_set_current)(kvh_CUcontext);
	int (*mem_alloc)(kvh_CUdeviceptr *, size_t);
	int (*mem_free)(kvh_CUdeviceptr);
	int (*ipc_get_mem_handle)(kvh_CUipcMemHandle *, kvh_CUdeviceptr);
	int (*ipc_open_mem_handle)(kvh_CUdeviceptr *, kvh_CUipcMemHandle, unsigned int);
	int (*ipc_close_mem_handle)(kvh_CUdeviceptr);
	int (*stream_create)(kvh_CUstream *, unsigned int);
	int (*stream_destroy)(kvh_CUstream);
	int (*stream_synchronize)(kvh_CUstream);
	int (*memcpy_async)(kvh_CUdeviceptr, kvh_CUdeviceptr, size_t, kvh_CUstream);
	int (*memcpy_htod)(kvh_CUdeviceptr, const void *, size_t);
	int (*memcpy_dtoh)(void *, kvh_CUdeviceptr, size_t);
	int (*event_create)(kvh_CUevent *, unsigned int);
	int (*event_destroy)(kvh_CUevent);
	int (*event_record)(kvh_CUevent, kvh_CUstream);
	int (*event_query)(kvh_CUevent);
	int (*device_can_access_peer)(int *, kvh_CUdevice, kvh_CUdevice);
	int (*ctx_enable_peer_access)(kvh_CUcontext, unsigned int);
	int (*device_get_uuid)(unsigned char *, kvh_CUdevice);
	int (*mem_get_address_range)(kvh_CUdeviceptr *, size_t *, kvh_CUdeviceptr);
	// Optional (CUDA 10.2+): virtual memory management, by which engines pass GPU memory as
	// POSIX file descriptors. NULL where the driver lacks any of them.
	int (*mem_import)(kvh_CUmemGenericAllocationHandle *, void *, int);
	int (*mem_export)(void *, kvh_CUmemGenericAllocationHandle, int, unsigned long long);
	int (*mem_props)(kvh_CUmemAllocationProp *, kvh_CUmemGenericAllocationHandle);
	int (*mem_granularity)(size_t *, const kvh_CUmemAllocationProp *, int);
	int (*mem_create)(kvh_CUmemGenericAllocationHandle *, size_t, const kvh_CUmemAllocationProp *, unsigned long long);
	int (*mem_release)(kvh_CUmemGenericAllocationHandle);
	int (*mem_reserve)(kvh_CUdeviceptr *, size_t, size_t, kvh_CUdeviceptr, unsigned long long);
	int (*mem_address_free)(kvh_CUdeviceptr, size_t);
	int (*mem_map)(kvh_CUdeviceptr, size_t, size_t, kvh_CUmemGenericAllocationHandle, unsigned long long);
	int (*mem_unmap)(kvh_CUdeviceptr, size_t);
	int (*mem_set_access)(kvh_CUdeviceptr, size_t, const kvh_CUmemAccessDesc *, size_t);
	// Optional: cuMemcpyBatchAsync as CUDA 13 declares it (no failIdx), NULL before 13.
	int (*memcpy_batch)(kvh_CUdeviceptr *, kvh_CUdeviceptr *, size_t *, size_t, kvh_CUmemcpyAttributes *, size_t *, size_t, kvh_CUstream);
} cu;

// kvh_cu_load resolves every entry point, naming the first missing one in missing.
int kvh_cu_load(const char *path, char *missing, size_t missing_len) {
	void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
	if (!lib) {
		snprintf(missing, missing_len, "%s", dlerror());
		return KVH_NO_DRIVER;
	}
#define SYM(field, name) \
	if (!(*(void **)&cu.field = dlsym(lib, name))) { snprintf(missing, missing_len, "%s", name); return KVH_NO_SYMBOL; }
	SYM(init, "cuInit");
	SYM(get_error_string, "cuGetErrorString");
	SYM(device_get_count, "cuDeviceGetCount");
	SYM(device_get, "cuDeviceGet");
	SYM(primary_ctx_retain, "cuDevicePrimaryCtxRetain");
	SYM(primary_ctx_release, "cuDevicePrimaryCtxRelease_v2");
	SYM(ctx_set_current, "cuCtxSetCurrent");
	SYM(mem_alloc, "cuMemAlloc_v2");
	SYM(mem_free, "cuMemFree_v2");
	SYM(ipc_get_mem_handle, "cuIpcGetMemHandle");
	SYM(ipc_open_mem_handle, "cuIpcOpenMemHandle_v2");
	SYM(ipc_close_mem_handle, "cuIpcCloseMemHandle");
	SYM(stream_create, "cuStreamCreate");
	SYM(stream_destroy, "cuStreamDestroy_v2");
	SYM(stream_synchronize, "cuStreamSynchronize");
	SYM(memcpy_async, "cuMemcpyAsync");
	SYM(memcpy_htod, "cuMemcpyHtoD_v2");
	SYM(memcpy_dtoh, "cuMemcpyDtoH_v2");
	SYM(event_create, "cuEventCreate");
	SYM(event_destroy, "cuEventDestroy_v2");
	SYM(event_record, "cuEventRecord");
	SYM(event_query, "cuEventQuery");
	SYM(device_can_access_peer, "cuDeviceCanAccessPeer");
	SYM(ctx_enable_peer_access, "cuCtxEnablePeerAccess");
	SYM(device_get_uuid, "cuDeviceGetUuid");
	SYM(mem_get_address_range, "cuMemGetAddressRange_v2");
#undef SYM
	*(void **)&cu.memcpy_batch = dlsym(lib, "cuMemcpyBatchAsync_v2");
	*(void **)&cu.mem_import = dlsym(lib, "cuMemImportFromShareableHandle");
	*(void **)&cu.mem_export = dlsym(lib, "cuMemExportToShareableHandle");
	*(void **)&cu.mem_props = dlsym(lib, "cuMemGetAllocationPropertiesFromHandle");
	*(void **)&cu.mem_granularity = dlsym(lib, "cuMemGetAllocationGranularity");
	*(void **)&cu.mem_create = dlsym(lib, "cuMemCreate");
	*(void **)&cu.mem_release = dlsym(lib, "cuMemRelease");
	*(void **)&cu.mem_reserve = dlsym(lib, "cuMemAddressReserve");
	*(void **)&cu.mem_address_free = dlsym(lib, "cuMemAddressFree");
	*(void **)&cu.mem_map = dlsym(lib, "cuMemMap");
	*(void **)&cu.mem_unmap = dlsym(lib, "cuMemUnmap");
	*(void **)&cu.mem_set_access = dlsym(lib, "cuMemSetAccess");
	return KVH_CUDA_SUCCESS;
}

const char *kvh_cu_error(int res) {
	const char *s = NULL;
	if (cu.get_error_string && cu.get_error_string(res, &s) == 0 && s) return s;
	return "unknown CUDA error";
}

int kvh_cu_init(void) { return cu.init(0); }
int kvh_cu_device_count(int *n) { return cu.device_get_count(n); }

int kvh_cu_primary_ctx(int ordinal, kvh_CUcontext *ctx) {
	kvh_CUdevice dev;
	int r = cu.device_get(&dev, ordinal);
	return r ? r : cu.primary_ctx_retain(ctx, dev);
}

int kvh_cu_release_ctx(int ordinal) {
	kvh_CUdevice dev;
	int r = cu.device_get(&dev, ordinal);
	return r ? r : cu.primary_ctx_release(dev);
}

// Every call that needs a context makes it current on the calling thread first, within
// the same C call: Go moves goroutines between threads, so a context set by an earlier
// call may be on another thread by now.
#define ON(ctx) do { int r_ = cu.ctx_set_current(ctx); if (r_) return r_; } while (0)
int kvh_cu_alloc(kvh_CUcontext ctx, kvh_CUdeviceptr *p, size_t n) { ON(ctx); return cu.mem_alloc(p, n); }
int kvh_cu_free(kvh_CUcontext ctx, kvh_CUdeviceptr p) { ON(ctx); return cu.mem_free(p); }
int kvh_cu_ipc_get(kvh_CUcontext ctx, kvh_CUipcMemHandle *h, kvh_CUdeviceptr p) { ON(ctx); return cu.ipc_get_mem_handle(h, p); }
// CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS (1): the importer may be another GPU than the owner.
int kvh_cu_ipc_open(kvh_CUcontext ctx, kvh_CUdeviceptr *p, const kvh_CUipcMemHandle *h) { ON(ctx); return cu.ipc_open_mem_handle(p, *h, 1); }
int kvh_cu_ipc_close(kvh_CUcontext ctx, kvh_CUdeviceptr p) { ON(ctx); return cu.ipc_close_mem_handle(p); }
// CU_STREAM_NON_BLOCKING (1): no implicit ordering with the legacy default stream.
int kvh_cu_stream_create(kvh_CUcontext ctx, kvh_CUstream *s) { ON(ctx); return cu.stream_create(s, 1); }
int kvh_cu_stream_destroy(kvh_CUcontext ctx, kvh_CUstream s) { ON(ctx); return cu.stream_destroy(s); }
int kvh_cu_stream_sync(kvh_CUcontext ctx, kvh_CUstream s) { ON(ctx); return cu.stream_synchronize(s); }
int kvh_cu_copy_async(kvh_CUcontext ctx, kvh_CUdeviceptr dst, kvh_CUdeviceptr src, size_t n, kvh_CUstream s) { ON(ctx); return cu.memcpy_async(dst, src, n, s); }
int kvh_cu_has_batch(void) { return cu.memcpy_batch != NULL; }
// kvh_cu_copy_batch queues count copies with one call from Go and one context switch:
// with the driver's batch copy where it has one (one submission for all: a cuMemcpyAsync
// costs about 5 µs of CPU on an H200 host, and a request is a hundred copies or more),
// else one cuMemcpyAsync each. queued is how many were queued before an error. A refused
// batch is queued again copy by copy, which names the failing copy: copies are
// idempotent, so any of the batch that did run does no harm running twice.
int kvh_cu_copy_batch(kvh_CUcontext ctx, const uint64_t *dst, const uint64_t *src, const uint64_t *n, int count, kvh_CUstream s, int *queued) {
	ON(ctx);
	*queued = 0;
	if (cu.memcpy_batch && count > 1) {
		// One attribute for all: the sources are read in stream order (after whatever the
		// stream ran before), with no location hints (those are for managed memory).
		kvh_CUmemcpyAttributes attr;
		memset(&attr, 0, sizeof attr);
		attr.src_access_order = 1; // CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
		size_t attr_idx = 0;
		if (cu.memcpy_batch((kvh_CUdeviceptr *)dst, (kvh_CUdeviceptr *)src, (size_t *)n, (size_t)count, &attr, &attr_idx, 1, s) == 0) {
			*queued = count;
			return 0;
		}
	}
	for (; *queued < count; (*queued)++) {
		int r = cu.memcpy_async(dst[*queued], src[*queued], n[*queued], s);
		if (r) return r;
	}
	return 0;
}
int kvh_cu_htod(kvh_CUcontext ctx, kvh_CUdeviceptr dst, const void *src, size_t n) { ON(ctx); return cu.memcpy_htod(dst, src, n); }
int kvh_cu_dtoh(kvh_CUcontext ctx, void *dst, kvh_CUdeviceptr src, size_t n) { ON(ctx); return cu.memcpy_dtoh(dst, src, n); }
// CU_EVENT_DISABLE_TIMING (2): completion only, the cheapest kind.
int kvh_cu_event_create(kvh_CUcontext ctx, kvh_CUevent *e) { ON(ctx); return cu.event_create(e, 2); }
int kvh_cu_event_destroy(kvh_CUcontext ctx, kvh_CUevent e) { ON(ctx); return cu.event_destroy(e); }
int kvh_cu_event_record(kvh_CUcontext ctx, kvh_CUevent e, kvh_CUstream s) { ON(ctx); return cu.event_record(e, s); }
int kvh_cu_event_query(kvh_CUcontext ctx, kvh_CUevent e) { ON(ctx); return cu.event_query(e); }
int kvh_cu_can_access_peer(int *can, int dev, int peer) { return cu.device_can_access_peer(can, dev, peer); }

int kvh_cu_device_uuid(int ordinal, unsigned char uuid[16]) {
	kvh_CUdevice dev;
	int r = cu.device_get(&dev, ordinal);
	return r ? r : cu.device_get_uuid(uuid, dev);
}

int kvh_cu_address_range(kvh_CUcontext ctx, kvh_CUdeviceptr p, kvh_CUdeviceptr *base, size_t *size) {
	ON(ctx);
	return cu.mem_get_address_range(base, size, p);
}
int kvh_cu_enable_peer(kvh_CUcontext ctx, kvh_CUcontext peer) { ON(ctx); return cu.ctx_enable_peer_access(peer, 0); }

int kvh_cu_has_vmm(void) {
	return cu.mem_import && cu.mem_export && cu.mem_props && cu.mem_granularity && cu.mem_create && cu.mem_release &&
	       cu.mem_reserve && cu.mem_address_free && cu.mem_map && cu.mem_unmap && cu.mem_set_access;
}

// kvh_cu_vmm_import opens the allocation an exporter passed as a POSIX fd (the fd stays the
// caller's to close) and says which GPU holds it and the granularity its mappings take.
int kvh_cu_vmm_import(int fd, kvh_CUmemGenericAllocationHandle *h, int *ordinal, size_t *granularity) {
	int r = cu.mem_import(h, (void *)(intptr_t)fd, KVH_CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
	if (r) return r;
	kvh_CUmemAllocationProp prop;
	memset(&prop, 0, sizeof prop);
	if (!(r = cu.mem_props(&prop, *h)) && !(r = cu.mem_granularity(granularity, &prop, 0))) {
		if (prop.location.type != KVH_CU_MEM_LOCATION_TYPE_DEVICE) r = KVH_CUDA_ERROR_INVALID_VALUE;
		*ordinal = prop.location.id;
	}
	if (r) cu.mem_release(*h);
	return r;
}

// kvh_cu_vmm_map maps the first size bytes of an imported allocation at a new address,
// readable and writable from devs, and gives up the handle (the mapping holds the
// memory now), whatever the outcome. The driver refuses a size beyond the allocation.
int kvh_cu_vmm_map(kvh_CUcontext ctx, kvh_CUmemGenericAllocationHandle h, size_t size, const int *devs, int ndevs, kvh_CUdeviceptr *p) {
	int r = cu.ctx_set_current(ctx);
	if (!r) r = cu.mem_reserve(p, size, 0, 0, 0);
	if (r) {
		cu.mem_release(h);
		return r;
	}
	r = cu.mem_map(*p, size, 0, h, 0);
	cu.mem_release(h);
	if (r) {
		cu.mem_address_free(*p, size);
		return r;
	}
	kvh_CUmemAccessDesc access[ndevs];
	for (int i = 0; i < ndevs; i++) {
		access[i].location.type = KVH_CU_MEM_LOCATION_TYPE_DEVICE;
		access[i].location.id = devs[i];
		access[i].flags = KVH_CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
	}
	if ((r = cu.mem_set_access(*p, size, access, ndevs))) kvh_cu_vmm_unmap(ctx, *p, size);
	return r;
}

void kvh_cu_vmm_release(kvh_CUmemGenericAllocationHandle h) { cu.mem_release(h); }

int kvh_cu_vmm_unmap(kvh_CUcontext ctx, kvh_CUdeviceptr p, size_t size) {
	int r = cu.ctx_set_current(ctx);
	if (!r) r = cu.mem_unmap(p, size);
	int f = cu.mem_address_free(p, size);
	return r ? r : f;
}

// kvh_cu_vmm_alloc makes size bytes (rounded up to the granularity, which size then
// says) on GPU ordinal that can be exported as a POSIX fd, maps them for that GPU, and
// exports them (fd): what an engine does with its KV cache, for the tests.
int kvh_cu_vmm_alloc(kvh_CUcontext ctx, int ordinal, size_t *size, kvh_CUdeviceptr *p, int *fd) {
	kvh_CUmemAllocationProp prop;
	memset(&prop, 0, sizeof prop);
	prop.type = KVH_CU_MEM_ALLOCATION_TYPE_PINNED;
	prop.requested_handle_types = KVH_CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
	prop.location.type = KVH_CU_MEM_LOCATION_TYPE_DEVICE;
	prop.location.id = ordinal;
	size_t g;
	kvh_CUmemGenericAllocationHandle h;
	int r = cu.ctx_set_current(ctx);
	if (!r) r = cu.mem_granularity(&g, &prop, 0);
	if (r) return r;
	*size = (*size + g - 1) / g * g;
	if ((r = cu.mem_create(&h, *size, &prop, 0))) return r;
	if ((r = cu.mem_export(fd, h, KVH_CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0))) {
		cu.mem_release(h);
		return r;
	}
	if ((r = kvh_cu_vmm_map(ctx, h, *size, &ordinal, 1, p))) close(*fd);
	return r;
}
