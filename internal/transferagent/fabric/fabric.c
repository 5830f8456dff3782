// C side of package fabric: libfabric's API is almost entirely static inline functions
// and macros, which cgo cannot call; these wrappers give Go real symbols.
#include "fabric.h"
#include <malloc.h>
#include <stdlib.h>
#include <string.h>

// kvh_open opens an RDM endpoint on provider, on the named domain (a NIC) or, with
// domain NULL, the first the provider offers. rail asks for what one rail of several
// needs: writes that complete locally only once their data is placed at the target (a
// signal on one rail must not overtake writes on another; EFA always asks for it), and
// thread safety, since a rail's completions are read by its own thread while the owner
// posts on it.
int kvh_open(const char *provider, const char *domain, int rail, kvh_ep *e) {
	memset(e, 0, sizeof(*e));
	struct fi_info *hints = fi_allocinfo();
	if (!hints) return -FI_ENOMEM;
	hints->ep_attr->type = FI_EP_RDM;
	hints->caps = FI_RMA | FI_WRITE | FI_REMOTE_WRITE | FI_READ | FI_REMOTE_READ | FI_MSG;
	hints->mode = FI_CONTEXT | FI_CONTEXT2;
	// Accept what EFA needs; providers that need less ignore the extra bits.
	hints->domain_attr->mr_mode = FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY;
	if (strcmp(provider, "tcp;ofi_rxm") == 0) {
		// EFA-style mr_mode made tcp;ofi_rxm hang here (docs/design.md, libfabric pitfall 6): ask for basic keys.
		hints->domain_attr->mr_mode = FI_MR_VIRT_ADDR | FI_MR_PROV_KEY | FI_MR_ALLOCATED;
	}
	if (rail) hints->domain_attr->threading = FI_THREAD_SAFE;
	if (rail || strcmp(provider, "efa") == 0) {
		// EFA completes a write locally before the data is placed; ask for completion on
		// delivery, so the signal that follows a request's writes cannot overtake them.
		hints->tx_attr->op_flags |= FI_DELIVERY_COMPLETE;
	}
	hints->fabric_attr->prov_name = strdup(provider);
	struct fi_info *all = NULL;
	int ret = fi_getinfo(FI_VERSION(1, 17), NULL, NULL, 0, hints, &all);
	fi_freeinfo(hints);
	if (ret) return ret;
	// The first match, or the first on the named domain: providers differ in whether they
	// filter by a domain name in the hints (tcp;ofi_rxm and sockets do not, in 1.17).
	struct fi_info *pick = all;
	while (domain && pick && strcmp(pick->domain_attr->name, domain) != 0) pick = pick->next;
	e->info = pick ? fi_dupinfo(pick) : NULL;
	fi_freeinfo(all);
	if (!e->info) return pick ? -FI_ENOMEM : -FI_ENODATA;
	if ((ret = fi_fabric(e->info->fabric_attr, &e->fabric, NULL))) return ret;
	if ((ret = fi_domain(e->fabric, e->info, &e->domain, NULL))) return ret;
	struct fi_av_attr av_attr = {.type = FI_AV_TABLE};
	if ((ret = fi_av_open(e->domain, &av_attr, &e->av, NULL))) return ret;
	// A CQ with a wait object lets an endpoint sleep in the kernel until its sockets have
	// work (data arriving, a completion) instead of spinning. Only socket-based providers
	// make progress inside such a wait: shm accepted a wait object here but moved no data
	// while waiting, and efa is polled from a core by design. Those get a plain CQ.
	int want_wait = strstr(provider, "ofi_rxm") != NULL || strcmp(provider, "sockets") == 0;
	struct fi_cq_attr cq_attr = {.format = FI_CQ_FORMAT_DATA, .wait_obj = want_wait ? FI_WAIT_UNSPEC : FI_WAIT_NONE};
	e->waitable = want_wait;
	if (fi_cq_open(e->domain, &cq_attr, &e->cq, NULL)) {
		cq_attr.wait_obj = FI_WAIT_NONE;
		e->waitable = 0;
		if ((ret = fi_cq_open(e->domain, &cq_attr, &e->cq, NULL))) return ret;
	}
	if ((ret = fi_endpoint(e->domain, e->info, &e->ep, NULL))) return ret;
	if ((ret = fi_ep_bind(e->ep, &e->av->fid, 0))) return ret;
	if ((ret = fi_ep_bind(e->ep, &e->cq->fid, FI_TRANSMIT | FI_RECV))) return ret;
	return fi_enable(e->ep);
}

const char *kvh_domain(kvh_ep *e) { return e->info->domain_attr->name; }

// kvh_domains writes the names of provider's RDM domains into out, each once, in the
// order fi_getinfo gives them, each followed by a newline; it returns the length needed.
int kvh_domains(const char *provider, char *out, size_t len) {
	struct fi_info *hints = fi_allocinfo(), *info = NULL;
	if (!hints) return -FI_ENOMEM;
	hints->ep_attr->type = FI_EP_RDM;
	hints->fabric_attr->prov_name = strdup(provider);
	int ret = fi_getinfo(FI_VERSION(1, 17), NULL, NULL, 0, hints, &info);
	fi_freeinfo(hints);
	if (ret) return ret;
	size_t used = 0;
	if (len) out[0] = 0;
	for (struct fi_info *i = info; i; i = i->next) {
		const char *name = i->domain_attr->name;
		size_t n = strlen(name);
		int seen = 0;
		for (struct fi_info *j = info; j != i && !seen; j = j->next) seen = strcmp(j->domain_attr->name, name) == 0;
		if (seen) continue;
		if (used + n + 2 <= len) {
			memcpy(out + used, name, n);
			out[used + n] = '\n';
			out[used + n + 1] = 0;
		}
		used += n + 1;
	}
	fi_freeinfo(info);
	return (int)used;
}

void kvh_close(kvh_ep *e) {
	if (e->ep) fi_close(&e->ep->fid);
	if (e->cq) fi_close(&e->cq->fid);
	if (e->av) fi_close(&e->av->fid);
	if (e->domain) fi_close(&e->domain->fid);
	if (e->fabric) fi_close(&e->fabric->fid);
	if (e->info) fi_freeinfo(e->info);
	memset(e, 0, sizeof(*e));
	// Give the freed pages back: each session opens its endpoint from its own thread, so
	// the provider's buffers were in that thread's malloc arena, which glibc does not
	// shrink on its own; without this, closed sessions' memory stayed with the agent.
	malloc_trim(0);
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
int kvh_has_dmabuf(void) {
#ifdef FI_MR_DMABUF
	return 1;
#else
	return 0;
#endif
}

// kvh_mr_reg_dmabuf registers device memory exported as a dmabuf (libfabric >= 1.20).
// Built against older headers (Debian's 1.17) it reports FI_ENOSYS.
int kvh_mr_reg_dmabuf(kvh_ep *e, int fd, uint64_t offset, size_t len, int iface, uint64_t access, uint64_t requested_key, struct fid_mr **mr) {
#ifdef FI_MR_DMABUF
	struct fi_mr_dmabuf dmabuf = {.fd = fd, .offset = offset, .len = len, .base_addr = NULL};
	struct fi_mr_attr attr = {0};
	attr.dmabuf = &dmabuf;
	attr.iov_count = 1;
	attr.access = access;
	attr.requested_key = requested_key;
	attr.iface = (enum fi_hmem_iface)iface;
	return fi_mr_regattr(e->domain, &attr, FI_MR_DMABUF, mr);
#else
	(void)e; (void)fd; (void)offset; (void)len; (void)iface; (void)access; (void)requested_key; (void)mr;
	return -FI_ENOSYS;
#endif
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
ssize_t kvh_read(kvh_ep *e, void *buf, size_t len, void *desc, fi_addr_t src, uint64_t addr, uint64_t key, void *ctx) {
	return fi_read(e->ep, buf, len, desc, src, addr, key, ctx);
}

// kvh_sread is kvh_poll, but blocks up to timeout_ms for a completion (or kvh_signal).
ssize_t kvh_sread(kvh_ep *e, struct fi_cq_data_entry *out, size_t n, int timeout_ms, void **err_ctx, int *err_code) {
	ssize_t ret = fi_cq_sread(e->cq, out, n, NULL, timeout_ms);
	// An interrupted wait is no error: Go's runtime preempts threads with signals (SIGURG),
	// and one landing in the provider's epoll_wait returns EINTR here.
	if (ret == -FI_EAGAIN || ret == -FI_ECANCELED || ret == -FI_ETIMEDOUT || ret == -FI_EINTR) return 0;
	if (ret == -FI_EAVAIL) {
		struct fi_cq_err_entry err = {0};
		fi_cq_readerr(e->cq, &err, 0);
		*err_ctx = err.op_context;
		*err_code = err.err;
		return -FI_EAVAIL;
	}
	return ret;
}

// kvh_signal wakes a thread blocked in kvh_sread.
int kvh_signal(kvh_ep *e) { return fi_cq_signal(e->cq); }

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
