#ifndef KVH_FABRIC_H
#define KVH_FABRIC_H
#include <rdma/fabric.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_rma.h>
#include <rdma/fi_errno.h>

typedef struct kvh_ep {
	struct fi_info *info;
	struct fid_fabric *fabric;
	struct fid_domain *domain;
	struct fid_av *av;
	struct fid_cq *cq;
	struct fid_ep *ep;
	int waitable;
} kvh_ep;

int kvh_open(const char *provider, const char *domain, int rail, kvh_ep *e);
const char *kvh_domain(kvh_ep *e);
int kvh_domains(const char *provider, char *out, size_t len);
void kvh_close(kvh_ep *e);
const char *kvh_provider(kvh_ep *e);
uint64_t kvh_mr_mode(kvh_ep *e);
size_t kvh_rma_iov_limit(kvh_ep *e);
size_t kvh_iov_limit(kvh_ep *e);
size_t kvh_max_msg_size(kvh_ep *e);
size_t kvh_cq_data_size(kvh_ep *e);
int kvh_getname(kvh_ep *e, void *addr, size_t *len);
int kvh_av_insert(kvh_ep *e, const void *addr, fi_addr_t *out);
int kvh_mr_reg(kvh_ep *e, void *buf, size_t len, uint64_t access, uint64_t requested_key, struct fid_mr **mr);
int kvh_has_dmabuf(void);
int kvh_mr_reg_dmabuf(kvh_ep *e, int fd, uint64_t offset, size_t len, int iface, uint64_t access, uint64_t requested_key, struct fid_mr **mr);
uint64_t kvh_mr_key(struct fid_mr *mr);
void *kvh_mr_desc(struct fid_mr *mr);
int kvh_mr_close(struct fid_mr *mr);
ssize_t kvh_write(kvh_ep *e, void *buf, size_t len, void *desc, fi_addr_t dest, uint64_t addr, uint64_t key, void *ctx);
ssize_t kvh_writedata(kvh_ep *e, void *buf, size_t len, void *desc, uint64_t data, fi_addr_t dest, uint64_t addr, uint64_t key, void *ctx);
ssize_t kvh_read(kvh_ep *e, void *buf, size_t len, void *desc, fi_addr_t src, uint64_t addr, uint64_t key, void *ctx);
ssize_t kvh_sread(kvh_ep *e, struct fi_cq_data_entry *out, size_t n, int timeout_ms, void **err_ctx, int *err_code);
int kvh_signal(kvh_ep *e);
ssize_t kvh_poll(kvh_ep *e, struct fi_cq_data_entry *out, size_t n, void **err_ctx, int *err_code);
#endif
