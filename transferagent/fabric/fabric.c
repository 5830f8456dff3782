// C side of package fabric: libfabric's API is almost entirely static inline functions
// and macros, which cgo cannot call; these wrappers give Go real symbols.
#include "fabric.h"
#include <stdlib.h>
#include <string.h>

int kvh_open(const char *provider, kvh_ep *e) {
	memset(e, 0, sizeof(*e));
	struct fi_info *hints = fi_allocinfo();
	if (!hints) return -FI_ENOMEM;
	hints->ep_attr->type = FI_EP_RDM;
	hints->caps = FI_RMA | FI_WRITE | FI_REMOTE_WRITE | FI_MSG;
	hints->mode = FI_CONTEXT | FI_CONTEXT2;
	// Accept what EFA needs; providers that need less ignore the extra bits.
	hints->domain_attr->mr_mode = FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY;
	if (strcmp(provider, "tcp;ofi_rxm") == 0) {
		// EFA-style mr_mode made tcp;ofi_rxm hang here (LIBFABRIC-NOTES 6): ask for basic keys.
		hints->domain_attr->mr_mode = FI_MR_VIRT_ADDR | FI_MR_PROV_KEY | FI_MR_ALLOCATED;
	}
	hints->fabric_attr->prov_name = strdup(provider);
	int ret = fi_getinfo(FI_VERSION(1, 17), NULL, NULL, 0, hints, &e->info);
	fi_freeinfo(hints);
	if (ret) return ret;
	if ((ret = fi_fabric(e->info->fabric_attr, &e->fabric, NULL))) return ret;
	if ((ret = fi_domain(e->fabric, e->info, &e->domain, NULL))) return ret;
	struct fi_av_attr av_attr = {.type = FI_AV_TABLE};
	if ((ret = fi_av_open(e->domain, &av_attr, &e->av, NULL))) return ret;
	struct fi_cq_attr cq_attr = {.format = FI_CQ_FORMAT_DATA, .wait_obj = FI_WAIT_NONE};
	if ((ret = fi_cq_open(e->domain, &cq_attr, &e->cq, NULL))) return ret;
	if ((ret = fi_endpoint(e->domain, e->info, &e->ep, NULL))) return ret;
	if ((ret = fi_ep_bind(e->ep, &e->av->fid, 0))) return ret;
	if ((ret = fi_ep_bind(e->ep, &e->cq->fid, FI_TRANSMIT | FI_RECV))) return ret;
	return fi_enable(e->ep);
}

void kvh_close(kvh_ep *e) {
	if (e->ep) fi_close(&e->ep->fid);
	if (e->cq) fi_close(&e->cq->fid);
	if (e->av) fi_close(&e->av->fid);
	if (e->domain) fi_close(&e->domain->fid);
	if (e->fabric) fi_close(&e->fabric->fid);
	if (e->info) fi_freeinfo(e->info);
	memset(e, 0, sizeof(*e));
}

const char *kvh_provider(kvh_ep *e) { return e->info->fabric_attr->prov_name; }
uint64_t kvh_mr_mode(kvh_ep *e) { return e->info->domain_attr->mr_mode; }
size_t kvh_rma_iov_limit(kvh_ep *e) { return e->info->tx_attr->rma_iov_limit; }
size_t kvh_iov_limit(kvh_ep *e) { return e->info->tx_attr->iov_limit; }
size_t kvh_max_msg_size(kvh_ep *e) { return e->info->ep_attr->max_msg_size; }
size_t kvh_cq_data_size(kvh_ep *e) { return e->info->domain_attr->cq_data_size; }

int kvh_getname(kvh_ep *e, void *addr, size_t *len) { return fi_getname(&e->ep->fid, addr, len); }

int kvh_av_insert(kvh_ep *e, const void *addr, fi_addr_t *out) {
	int n = fi_av_insert(e->av, addr, 1, out, 0, NULL);
	return n == 1 ? 0 : (n < 0 ? n : -FI_EINVAL);
}

int kvh_mr_reg(kvh_ep *e, void *buf, size_t len, uint64_t access, uint64_t requested_key, struct fid_mr **mr) {
	return fi_mr_reg(e->domain, buf, len, access, 0, requested_key, 0, mr, NULL);
}
uint64_t kvh_mr_key(struct fid_mr *mr) { return fi_mr_key(mr); }
void *kvh_mr_desc(struct fid_mr *mr) { return fi_mr_desc(mr); }
int kvh_mr_close(struct fid_mr *mr) { return fi_close(&mr->fid); }

ssize_t kvh_write(kvh_ep *e, void *buf, size_t len, void *desc, fi_addr_t dest, uint64_t addr, uint64_t key, void *ctx) {
	return fi_write(e->ep, buf, len, desc, dest, addr, key, ctx);
}
ssize_t kvh_writedata(kvh_ep *e, void *buf, size_t len, void *desc, uint64_t data, fi_addr_t dest, uint64_t addr, uint64_t key, void *ctx) {
	return fi_writedata(e->ep, buf, len, desc, data, dest, addr, key, ctx);
}
ssize_t kvh_recv(kvh_ep *e, void *buf, size_t len, void *desc, void *ctx) {
	return fi_recv(e->ep, buf, len, desc, FI_ADDR_UNSPEC, ctx);
}

// kvh_poll reads up to n completions; returns how many, 0 when none, or a negative error
// (with the failed operation's context and provider error in err_ctx/err_code).
ssize_t kvh_poll(kvh_ep *e, struct fi_cq_data_entry *out, size_t n, void **err_ctx, int *err_code) {
	ssize_t ret = fi_cq_read(e->cq, out, n);
	if (ret == -FI_EAGAIN) return 0;
	if (ret == -FI_EAVAIL) {
		struct fi_cq_err_entry err = {0};
		fi_cq_readerr(e->cq, &err, 0);
		*err_ctx = err.op_context;
		*err_code = err.err;
		return -FI_EAVAIL;
	}
	return ret;
}
