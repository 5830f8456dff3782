#ifndef KVH_CUDA_H
#define KVH_CUDA_H
#include <stddef.h>
#include <stdint.h>

// The CUDA driver API's types as the driver's ABI defines them, declared here so that the
// package builds without CUDA's headers: the driver is loaded at run time (dlopen).
typedef int kvh_CUresult;
typedef int kvh_CUdevice;
typedef void *kvh_CUcontext;
typedef void *kvh_CUstream;
typedef void *kvh_CUevent;
typedef unsigned long long kvh_CUdeviceptr;
typedef struct { char reserved[64]; } kvh_CUipcMemHandle;
typedef unsigned long long kvh_CUmemGenericAllocationHandle;
// CUmemcpyAttributes (CUDA 12.8+): source access order, source and destination location
// hints (a CUmemLocation each: type and id), flags.
typedef struct {
	int src_access_order;
	int src_hint_type, src_hint_id;
	int dst_hint_type, dst_hint_id;
	unsigned int flags;
} kvh_CUmemcpyAttributes;

// CUmemAllocationProp, CUmemLocation and CUmemAccessDesc (virtual memory management).
typedef struct { int type, id; } kvh_CUmemLocation;
typedef struct {
	int type;
	int requested_handle_types;
	kvh_CUmemLocation location;
	void *win32_handle_meta_data;
	unsigned char compression_type, gpu_direct_rdma_capable;
	unsigned short usage;
	unsigned char reserved[4];
} kvh_CUmemAllocationProp;
typedef struct {
	kvh_CUmemLocation location;
	int flags;
} kvh_CUmemAccessDesc;
#define KVH_CU_MEM_ALLOCATION_TYPE_PINNED 1
#define KVH_CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR 1
#define KVH_CU_MEM_LOCATION_TYPE_DEVICE 1
#define KVH_CU_MEM_ACCESS_FLAGS_PROT_READWRITE 3

// Results the package tells apart.
#define KVH_CUDA_SUCCESS 0
#define KVH_CUDA_ERROR_INVALID_VALUE 1
#define KVH_CUDA_ERROR_NOT_READY 600
#define KVH_CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED 704
// kvh_cu_load's own results: no driver, or a driver without a needed entry point.
#define KVH_NO_DRIVER -1
#define KVH_NO_SYMBOL -2

int kvh_cu_load(const char *path, char *missing, size_t missing_len);
const char *kvh_cu_error(int res);
int kvh_cu_init(void);
int kvh_cu_device_count(int *n);
int kvh_cu_primary_ctx(int ordinal, kvh_CUcontext *ctx);
int kvh_cu_release_ctx(int ordinal);
int kvh_cu_alloc(kvh_CUcontext ctx, kvh_CUdeviceptr *p, size_t n);
int kvh_cu_free(kvh_CUcontext ctx, kvh_CUdeviceptr p);
int kvh_cu_ipc_get(kvh_CUcontext ctx, kvh_CUipcMemHandle *h, kvh_CUdeviceptr p);
int kvh_cu_ipc_open(kvh_CUcontext ctx, kvh_CUdeviceptr *p, const kvh_CUipcMemHandle *h);
int kvh_cu_ipc_close(kvh_CUcontext ctx, kvh_CUdeviceptr p);
int kvh_cu_stream_create(kvh_CUcontext ctx, kvh_CUstream *s);
int kvh_cu_stream_destroy(kvh_CUcontext ctx, kvh_CUstream s);
int kvh_cu_stream_sync(kvh_CUcontext ctx, kvh_CUstream s);
int kvh_cu_copy_async(kvh_CUcontext ctx, kvh_CUdeviceptr dst, kvh_CUdeviceptr src, size_t n, kvh_CUstream s);
int kvh_cu_has_batch(void);
int kvh_cu_copy_batch(kvh_CUcontext ctx, const uint64_t *dst, const uint64_t *src, const uint64_t *n, int count, kvh_CUstream s, int *queued);
int kvh_cu_htod(kvh_CUcontext ctx, kvh_CUdeviceptr dst, const void *src, size_t n);
int kvh_cu_dtoh(kvh_CUcontext ctx, void *dst, kvh_CUdeviceptr src, size_t n);
int kvh_cu_event_create(kvh_CUcontext ctx, kvh_CUevent *e);
int kvh_cu_event_destroy(kvh_CUcontext ctx, kvh_CUevent e);
int kvh_cu_event_record(kvh_CUcontext ctx, kvh_CUevent e, kvh_CUstream s);
int kvh_cu_event_query(kvh_CUcontext ctx, kvh_CUevent e);
int kvh_cu_can_access_peer(int *can, int dev, int peer);
int kvh_cu_device_uuid(int ordinal, unsigned char uuid[16]);
int kvh_cu_address_range(kvh_CUcontext ctx, kvh_CUdeviceptr p, kvh_CUdeviceptr *base, size_t *size);
int kvh_cu_enable_peer(kvh_CUcontext ctx, kvh_CUcontext peer);
int kvh_cu_has_vmm(void);
int kvh_cu_vmm_import(int fd, kvh_CUmemGenericAllocationHandle *h, int *ordinal, size_t *granularity);
int kvh_cu_vmm_map(kvh_CUcontext ctx, kvh_CUmemGenericAllocationHandle h, size_t size, const int *devs, int ndevs, kvh_CUdeviceptr *p);
void kvh_cu_vmm_release(kvh_CUmemGenericAllocationHandle h);
int kvh_cu_vmm_unmap(kvh_CUcontext ctx, kvh_CUdeviceptr p, size_t size);
int kvh_cu_vmm_alloc(kvh_CUcontext ctx, int ordinal, size_t *size, kvh_CUdeviceptr *p, int *fd);
#endif
