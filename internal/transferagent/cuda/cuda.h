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
// CUmemcpyAttributes (CUDA 12.8+): source access order, source and destination location
// hints (a CUmemLocation each: type and id), flags.
typedef struct {
	int src_access_order;
	int src_hint_type, src_hint_id;
	int dst_hint_type, dst_hint_id;
	unsigned int flags;
} kvh_CUmemcpyAttributes;

// Results the package tells apart.
#define KVH_CUDA_SUCCESS 0
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
#endif
