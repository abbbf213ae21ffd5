/* A fake CUDA driver for testing kvxfer's CUDA code on machines without a GPU: one device
 * whose memory the host cannot dereference (device pointers lie outside any user address
 * space; copies translate them), and streams whose asynchronous copies are *deferred* until
 * the stream is synchronized, so that a missing synchronization corrupts data and fails a
 * test instead of passing by luck. Pinned registrations are checked (unregistering memory
 * that was not registered, or a copy into an unregistered range counted as pageable, are
 * reported). Device memory lives in memory files, so that it can be shared between
 * processes as the real driver shares it: legacy IPC handles (the handle names the owner's
 * pid and descriptor; the opener maps /proc/<pid>/fd/<fd>) and virtual-memory allocations
 * exported as file descriptors. kvxfer's copy kernel (kvx_copy_batch) is "run" by doing what
 * its source says, deferred like a copy: the launch plumbing (table upload, parameters,
 * stream order) is tested, the PTX itself only on a GPU. Built by tests/fake_cuda.rs; see
 * stubs.c for the symbols it does not model. */
#define _GNU_SOURCE
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef struct ctx_s *CUcontext;
typedef struct stream_s *CUstream;
typedef struct event_s *CUevent;

#define OK 0
#define ERR_INVALID_VALUE 1
#define ERR_OUT_OF_MEMORY 2
#define ERR_INVALID_DEVICE 101
#define ERR_INVALID_CONTEXT 201

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
struct ctx_s { int device; };
static struct ctx_s the_ctx = {0};
static __thread CUcontext current = NULL;

/* Device memory: allocations at DEV_BASE + offset, backed by memory files mapped here that
 * the host cannot reach through a device pointer. */
#define DEV_BASE 0x7d00000000000000ull
#define MAX_ALLOCS 4096
enum { PLAIN, POOL, VMM, OPENED };
static struct {
  CUdeviceptr dev; unsigned char *host; size_t len; int kind; int fd; int handle;
} allocs[MAX_ALLOCS];
static CUdeviceptr next_dev = DEV_BASE;

/* Page-locked host memory (registered or allocated here): where a device pointer may be a
 * host address (cuMemHostGetDevicePointer gives the host address back, as UVA does). */
#define MAX_PINS 256
static struct { unsigned char *p; size_t len; int owned; } pins[MAX_PINS];

static unsigned char *pinned(CUdeviceptr p, size_t len) {
  for (int i = 0; i < MAX_PINS; i++) {
    unsigned char *b = pins[i].p;
    if (b && (unsigned char *)p >= b && (unsigned char *)p + len <= b + pins[i].len)
      return (unsigned char *)p;
  }
  return NULL;
}

static int find_alloc(CUdeviceptr p, size_t len) {
  for (int i = 0; i < MAX_ALLOCS; i++) {
    if (allocs[i].host && p >= allocs[i].dev && p + len <= allocs[i].dev + allocs[i].len)
      return i;
  }
  return -1;
}

static unsigned char *translate(CUdeviceptr p, size_t len) {
  int i = find_alloc(p, len);
  if (i >= 0) return allocs[i].host + (p - allocs[i].dev);
  fprintf(stderr, "fake libcuda: device range [%#llx, +%zu) is not allocated\n", p, len);
  abort();
}

/* What a kernel or a batch copy may address: device memory, or mapped page-locked memory. */
static unsigned char *resolve(CUdeviceptr p, size_t len) {
  unsigned char *h = pinned(p, len);
  return h ? h : translate(p, len);
}

/* A memory file of `len` bytes mapped here; -1 and NULL on failure. */
static unsigned char *map_file(int fd, size_t len) {
  void *m = mmap(NULL, len ? len : 1, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  return m == MAP_FAILED ? NULL : m;
}

static int new_file(size_t len) {
  int fd = memfd_create("fake-cuda", MFD_CLOEXEC);
  if (fd >= 0 && ftruncate(fd, len ? len : 1) != 0) { close(fd); return -1; }
  return fd;
}

/* Puts a mapping in the table at a fresh device address (mu held). */
static CUresult add_alloc(unsigned char *host, size_t len, int kind, int fd, int handle, CUdeviceptr at, CUdeviceptr *out) {
  for (int i = 0; i < MAX_ALLOCS; i++) {
    if (!allocs[i].host) {
      CUdeviceptr dev = at;
      if (!dev) {
        dev = next_dev;
        next_dev += (len + 0xfffff) & ~0xfffffull;
        next_dev += 1 << 20; /* a guard gap */
      }
      allocs[i].dev = dev; allocs[i].host = host; allocs[i].len = len;
      allocs[i].kind = kind; allocs[i].fd = fd; allocs[i].handle = handle;
      *out = dev;
      return OK;
    }
  }
  return ERR_OUT_OF_MEMORY;
}

static void drop_alloc(int i) {
  munmap(allocs[i].host, allocs[i].len ? allocs[i].len : 1);
  if (allocs[i].fd >= 0) close(allocs[i].fd);
  allocs[i].host = NULL;
}

/* Deferred copies. */
enum { H2D, D2H, SET, D2D, KERNEL };
struct op {
  int kind; void *host; CUdeviceptr dev; size_t len; unsigned char value; struct op *next;
  CUdeviceptr src; /* D2D: from src to dev */
  CUdeviceptr tab[3]; unsigned n; /* KERNEL: kvx_copy_batch's src, dst and len tables */
};
struct stream_s { struct op *head, *tail; CUcontext ctx; };

static void run(struct op *o) {
  if (o->kind == KERNEL) {
    /* kvx_copy_batch: entry e copies len[e] bytes from src[e] to dst[e]. */
    unsigned long long *src = (void *)translate(o->tab[0], 8ull * o->n);
    unsigned long long *dst = (void *)translate(o->tab[1], 8ull * o->n);
    unsigned long long *len = (void *)translate(o->tab[2], 8ull * o->n);
    for (unsigned e = 0; e < o->n; e++)
      memmove(resolve(dst[e], len[e]), resolve(src[e], len[e]), len[e]);
    return;
  }
  if (o->kind == D2D) {
    memmove(resolve(o->dev, o->len), resolve(o->src, o->len), o->len);
    return;
  }
  unsigned char *d = translate(o->dev, o->len);
  switch (o->kind) {
    case H2D: memcpy(d, o->host, o->len); break;
    case D2H: memcpy(o->host, d, o->len); break;
    case SET: memset(d, o->value, o->len); break;
  }
}

static void flush(CUstream s) {
  struct op *o = s ? s->head : NULL;
  while (o) {
    struct op *n = o->next;
    run(o);
    free(o);
    o = n;
  }
  if (s) s->head = s->tail = NULL;
}

#define MAX_STREAMS 1024
static CUstream streams[MAX_STREAMS];

static void put(CUstream s, struct op *o) {
  if (s == NULL) { /* the null stream: synchronous here */
    run(o);
    free(o);
  } else {
    if (s->tail) s->tail->next = o; else s->head = o;
    s->tail = o;
  }
}

static CUresult enqueue(CUstream s, int kind, void *host, CUdeviceptr dev, size_t len, unsigned char v) {
  if (current == NULL) return ERR_INVALID_CONTEXT;
  pthread_mutex_lock(&mu);
  translate(dev, len); /* bounds-check now, like the driver */
  struct op *o = calloc(1, sizeof *o);
  o->kind = kind; o->host = host; o->dev = dev; o->len = len; o->value = v;
  if (s == NULL) { /* the null stream: synchronous here */
    run(o);
    free(o);
  } else {
    if (s->tail) s->tail->next = o; else s->head = o;
    s->tail = o;
  }
  pthread_mutex_unlock(&mu);
  return OK;
}

CUresult cuInit(unsigned flags) { (void)flags; return OK; }
CUresult cuDriverGetVersion(int *v) { *v = 12080; return OK; }
CUresult cuDeviceGetCount(int *n) { *n = 1; return OK; }
CUresult cuDeviceGet(CUdevice *d, int ordinal) { if (ordinal != 0) return ERR_INVALID_DEVICE; *d = 0; return OK; }
/* Memory pools supported (115): cudarc then allocates from the stream-ordered pool
 * (cuMemAllocAsync), as on a real device; every other attribute 0. */
CUresult cuDeviceGetAttribute(int *v, int attr, CUdevice d) { (void)d; *v = attr == 115; return OK; }
CUresult cuDeviceGetName(char *name, int len, CUdevice d) { (void)d; snprintf(name, len, "kvxfer fake GPU"); return OK; }
CUresult cuDeviceTotalMem_v2(size_t *b, CUdevice d) { (void)d; *b = 1ull << 34; return OK; }
CUresult cuDevicePrimaryCtxRetain(CUcontext *c, CUdevice d) { if (d != 0) return ERR_INVALID_DEVICE; *c = &the_ctx; return OK; }
CUresult cuDevicePrimaryCtxRelease_v2(CUdevice d) { (void)d; return OK; }
CUresult cuCtxSetCurrent(CUcontext c) { current = c; return OK; }
CUresult cuCtxGetCurrent(CUcontext *c) { *c = current; return OK; }
CUresult cuCtxGetDevice(CUdevice *d) { if (!current) return ERR_INVALID_CONTEXT; *d = 0; return OK; }
CUresult cuCtxSynchronize(void) {
  if (!current) return ERR_INVALID_CONTEXT;
  pthread_mutex_lock(&mu);
  for (int i = 0; i < MAX_STREAMS; i++) if (streams[i]) flush(streams[i]);
  pthread_mutex_unlock(&mu);
  return OK;
}

CUresult cuStreamCreate(CUstream *s, unsigned flags) {
  (void)flags;
  if (!current) return ERR_INVALID_CONTEXT;
  pthread_mutex_lock(&mu);
  CUstream n = calloc(1, sizeof *n);
  n->ctx = current;
  for (int i = 0; i < MAX_STREAMS; i++) if (!streams[i]) { streams[i] = n; break; }
  pthread_mutex_unlock(&mu);
  *s = n;
  return OK;
}
CUresult cuCtxGetStreamPriorityRange(int *least, int *greatest) {
  *least = 0; *greatest = -5;
  return OK;
}
CUresult cuStreamCreateWithPriority(CUstream *s, unsigned flags, int priority) {
  if (priority < -5 || priority > 0) return ERR_INVALID_VALUE;
  return cuStreamCreate(s, flags);
}
CUresult cuStreamDestroy_v2(CUstream s) {
  pthread_mutex_lock(&mu);
  flush(s);
  for (int i = 0; i < MAX_STREAMS; i++) if (streams[i] == s) streams[i] = NULL;
  pthread_mutex_unlock(&mu);
  free(s);
  return OK;
}
CUresult cuStreamSynchronize(CUstream s) {
  pthread_mutex_lock(&mu);
  flush(s);
  pthread_mutex_unlock(&mu);
  return OK;
}
CUresult cuStreamQuery(CUstream s) { return cuStreamSynchronize(s); }

/* Events: recording completes the stream's work so far (conservative). */
struct event_s { int unused; };
CUresult cuEventCreate(CUevent *e, unsigned flags) { (void)flags; *e = calloc(1, sizeof **e); return OK; }
CUresult cuEventRecord(CUevent e, CUstream s) { (void)e; return cuStreamSynchronize(s); }
CUresult cuEventRecordWithFlags(CUevent e, CUstream s, unsigned f) { (void)f; return cuEventRecord(e, s); }
CUresult cuStreamWaitEvent(CUstream s, CUevent e, unsigned f) { (void)s; (void)e; (void)f; return OK; }
CUresult cuEventSynchronize(CUevent e) { (void)e; return OK; }
CUresult cuEventQuery(CUevent e) { (void)e; return OK; }
CUresult cuEventDestroy_v2(CUevent e) { free(e); return OK; }

static CUresult alloc_kind(CUdeviceptr *p, size_t len, int kind) {
  if (!current) return ERR_INVALID_CONTEXT;
  int fd = new_file(len);
  unsigned char *h = fd >= 0 ? map_file(fd, len) : NULL;
  if (!h) { if (fd >= 0) close(fd); return ERR_OUT_OF_MEMORY; }
  pthread_mutex_lock(&mu);
  CUresult r = add_alloc(h, len, kind, fd, 0, 0, p);
  pthread_mutex_unlock(&mu);
  if (r != OK) { munmap(h, len ? len : 1); close(fd); }
  return r;
}
CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t len) { return alloc_kind(p, len, PLAIN); }
CUresult cuMemAllocAsync(CUdeviceptr *p, size_t len, CUstream s) { (void)s; return alloc_kind(p, len, POOL); }
CUresult cuMemFree_v2(CUdeviceptr p) {
  pthread_mutex_lock(&mu);
  for (int i = 0; i < MAX_STREAMS; i++) if (streams[i]) flush(streams[i]);
  for (int i = 0; i < MAX_ALLOCS; i++) {
    if (allocs[i].host && allocs[i].dev == p && (allocs[i].kind == PLAIN || allocs[i].kind == POOL)) {
      drop_alloc(i);
      pthread_mutex_unlock(&mu);
      return OK;
    }
  }
  pthread_mutex_unlock(&mu);
  return ERR_INVALID_VALUE;
}
CUresult cuMemFreeAsync(CUdeviceptr p, CUstream s) { (void)s; return cuMemFree_v2(p); }

CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr d, const void *h, size_t n, CUstream s) { return enqueue(s, H2D, (void *)h, d, n, 0); }
CUresult cuMemcpyDtoHAsync_v2(void *h, CUdeviceptr d, size_t n, CUstream s) { return enqueue(s, D2H, h, d, n, 0); }
CUresult cuMemcpyHtoD_v2(CUdeviceptr d, const void *h, size_t n) { return enqueue(NULL, H2D, (void *)h, d, n, 0); }
CUresult cuMemcpyDtoH_v2(void *h, CUdeviceptr d, size_t n) { return enqueue(NULL, D2H, h, d, n, 0); }
CUresult cuMemsetD8Async(CUdeviceptr d, unsigned char v, size_t n, CUstream s) { return enqueue(s, SET, NULL, d, n, v); }
CUresult cuMemsetD8_v2(CUdeviceptr d, unsigned char v, size_t n) { return enqueue(NULL, SET, NULL, d, n, v); }

/* Page-locked host memory: registrations must be unregistered exactly. */
static CUresult pin(void *p, size_t len, int owned) {
  pthread_mutex_lock(&mu);
  for (int i = 0; i < MAX_PINS; i++) {
    if (!pins[i].p) {
      pins[i].p = p; pins[i].len = len; pins[i].owned = owned;
      pthread_mutex_unlock(&mu);
      return OK;
    }
  }
  pthread_mutex_unlock(&mu);
  return ERR_OUT_OF_MEMORY;
}
static CUresult unpin(void *p, int owned) {
  pthread_mutex_lock(&mu);
  for (int i = 0; i < MAX_PINS; i++) {
    if (pins[i].p == p && pins[i].owned == owned) {
      pins[i].p = NULL;
      pthread_mutex_unlock(&mu);
      return OK;
    }
  }
  pthread_mutex_unlock(&mu);
  fprintf(stderr, "fake libcuda: unpinning %p, which is not pinned that way\n", p);
  return ERR_INVALID_VALUE;
}
CUresult cuMemHostRegister_v2(void *p, size_t len, unsigned flags) {
  (void)flags;
  if (!current) return ERR_INVALID_CONTEXT;
  return pin(p, len, 0);
}
CUresult cuMemHostUnregister(void *p) { return unpin(p, 0); }
CUresult cuMemAllocHost_v2(void **p, size_t len) {
  if (!current) return ERR_INVALID_CONTEXT;
  *p = calloc(1, len ? len : 1);
  if (!*p) return ERR_OUT_OF_MEMORY;
  return pin(*p, len, 1);
}
CUresult cuMemFreeHost(void *p) {
  CUresult r = unpin(p, 1);
  if (r == OK) free(p);
  return r;
}
CUresult cuMemHostGetDevicePointer_v2(CUdeviceptr *d, void *p, unsigned flags) {
  if (flags != 0) return ERR_INVALID_VALUE;
  pthread_mutex_lock(&mu);
  unsigned char *h = pinned((CUdeviceptr)p, 1);
  pthread_mutex_unlock(&mu);
  if (!h) return ERR_INVALID_VALUE;
  *d = (CUdeviceptr)p;
  return OK;
}

/* Device-to-device copies and batches, deferred like the others. */
CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s) {
  if (!current) return ERR_INVALID_CONTEXT;
  pthread_mutex_lock(&mu);
  resolve(dst, n); resolve(src, n);
  struct op *o = calloc(1, sizeof *o);
  o->kind = D2D; o->dev = dst; o->src = src; o->len = n;
  put(s, o);
  pthread_mutex_unlock(&mu);
  return OK;
}
CUresult cuMemcpyBatchAsync(CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes, size_t count,
                            void *attrs, size_t *attrIdxs, size_t numAttrs, size_t *failIdx, CUstream s) {
  (void)attrs; (void)attrIdxs;
  if (numAttrs < 1 || count == 0) return ERR_INVALID_VALUE;
  for (size_t i = 0; i < count; i++) {
    CUresult r = cuMemcpyDtoDAsync_v2(dsts[i], srcs[i], sizes[i], s);
    if (r != OK) { *failIdx = i; return r; }
  }
  return OK;
}

/* kvxfer's copy kernel, loaded from its PTX. */
static int the_module, the_function;
CUresult cuModuleLoadData(void **m, const void *image) {
  if (!current) return ERR_INVALID_CONTEXT;
  if (!strstr((const char *)image, ".entry kvx_copy_batch")) return 218; /* INVALID_PTX */
  *m = &the_module;
  return OK;
}
CUresult cuModuleGetFunction(void **f, void *m, const char *name) {
  if (m != &the_module || strcmp(name, "kvx_copy_batch") != 0) return 500; /* NOT_FOUND */
  *f = &the_function;
  return OK;
}
CUresult cuModuleUnload(void *m) { return m == &the_module ? OK : ERR_INVALID_VALUE; }
CUresult cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                        unsigned bz, unsigned shared, CUstream s, void **params, void **extra) {
  (void)gy; (void)gz; (void)by; (void)bz; (void)shared; (void)extra;
  if (!current) return ERR_INVALID_CONTEXT;
  if (f != &the_function || gx == 0 || bx == 0 || !params) return ERR_INVALID_VALUE;
  pthread_mutex_lock(&mu);
  struct op *o = calloc(1, sizeof *o);
  o->kind = KERNEL;
  for (int i = 0; i < 3; i++) o->tab[i] = *(CUdeviceptr *)params[i];
  o->n = *(unsigned *)params[3];
  put(s, o);
  pthread_mutex_unlock(&mu);
  return OK;
}

/* What kind of allocation a pointer lies in. */
CUresult cuPointerGetAttribute(void *data, int attr, CUdeviceptr p) {
  pthread_mutex_lock(&mu);
  int i = find_alloc(p, 1);
  pthread_mutex_unlock(&mu);
  if (i < 0) return ERR_INVALID_VALUE;
  switch (attr) {
    case 17: /* MEMPOOL_HANDLE */ *(void **)data = allocs[i].kind == POOL ? (void *)&the_module : NULL; return OK;
    case 10: /* IS_LEGACY_CUDA_IPC_CAPABLE */ *(int *)data = allocs[i].kind == PLAIN; return OK;
    default: return ERR_INVALID_VALUE;
  }
}
CUresult cuMemGetAddressRange_v2(CUdeviceptr *base, size_t *size, CUdeviceptr p) {
  pthread_mutex_lock(&mu);
  int i = find_alloc(p, 1);
  pthread_mutex_unlock(&mu);
  if (i < 0) return ERR_INVALID_VALUE;
  if (base) *base = allocs[i].dev;
  if (size) *size = allocs[i].len;
  return OK;
}

/* Legacy IPC: the handle names the owner's pid and the allocation's memory file. */
typedef struct { char reserved[64]; } CUipcMemHandle;
struct ipc { char magic[8]; int pid; int fd; unsigned long long len; };
CUresult cuIpcGetMemHandle(CUipcMemHandle *h, CUdeviceptr p) {
  pthread_mutex_lock(&mu);
  int i = find_alloc(p, 1);
  pthread_mutex_unlock(&mu);
  if (i < 0 || allocs[i].dev != p || allocs[i].kind != PLAIN) return ERR_INVALID_VALUE;
  struct ipc x = {"KVXFAKE", getpid(), allocs[i].fd, allocs[i].len};
  memset(h, 0, sizeof *h);
  memcpy(h, &x, sizeof x);
  return OK;
}
CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *p, CUipcMemHandle h, unsigned flags) {
  (void)flags;
  if (!current) return ERR_INVALID_CONTEXT;
  struct ipc x;
  memcpy(&x, &h, sizeof x);
  if (memcmp(x.magic, "KVXFAKE", 8) != 0) return ERR_INVALID_VALUE;
  if (x.pid == getpid()) return ERR_INVALID_CONTEXT; /* the real driver refuses its own */
  char path[64];
  snprintf(path, sizeof path, "/proc/%d/fd/%d", x.pid, x.fd);
  int fd = open(path, O_RDWR | O_CLOEXEC);
  if (fd < 0) return ERR_INVALID_VALUE;
  unsigned char *m = map_file(fd, x.len);
  if (!m) { close(fd); return ERR_OUT_OF_MEMORY; }
  pthread_mutex_lock(&mu);
  CUresult r = add_alloc(m, x.len, OPENED, fd, 0, 0, p);
  pthread_mutex_unlock(&mu);
  return r;
}
CUresult cuIpcCloseMemHandle(CUdeviceptr p) {
  pthread_mutex_lock(&mu);
  for (int i = 0; i < MAX_STREAMS; i++) if (streams[i]) flush(streams[i]);
  for (int i = 0; i < MAX_ALLOCS; i++) {
    if (allocs[i].host && allocs[i].dev == p && allocs[i].kind == OPENED) {
      drop_alloc(i);
      pthread_mutex_unlock(&mu);
      return OK;
    }
  }
  pthread_mutex_unlock(&mu);
  return ERR_INVALID_VALUE;
}

/* Virtual memory: handles are memory files; a mapping puts one at a reserved address. */
#define MAX_HANDLES 1024
static struct { int fd; size_t len; int refs; } handles[MAX_HANDLES];
static int new_handle(int fd, size_t len) {
  for (int i = 1; i < MAX_HANDLES; i++) {
    if (!handles[i].refs) { handles[i].fd = fd; handles[i].len = len; handles[i].refs = 1; return i; }
  }
  return 0;
}
CUresult cuMemGetAllocationGranularity(size_t *g, const void *prop, int flags) {
  (void)prop; (void)flags;
  *g = 2 << 20;
  return OK;
}
CUresult cuMemCreate(unsigned long long *h, size_t len, const void *prop, unsigned long long flags) {
  (void)prop; (void)flags;
  if (!current) return ERR_INVALID_CONTEXT;
  int fd = new_file(len);
  if (fd < 0) return ERR_OUT_OF_MEMORY;
  pthread_mutex_lock(&mu);
  int i = new_handle(fd, len);
  pthread_mutex_unlock(&mu);
  if (!i) { close(fd); return ERR_OUT_OF_MEMORY; }
  *h = i;
  return OK;
}
CUresult cuMemRelease(unsigned long long h) {
  pthread_mutex_lock(&mu);
  if (h == 0 || h >= MAX_HANDLES || !handles[h].refs) { pthread_mutex_unlock(&mu); return ERR_INVALID_VALUE; }
  if (--handles[h].refs == 0) close(handles[h].fd);
  pthread_mutex_unlock(&mu);
  return OK;
}
CUresult cuMemAddressReserve(CUdeviceptr *p, size_t len, size_t align, CUdeviceptr addr, unsigned long long flags) {
  (void)align; (void)addr; (void)flags;
  pthread_mutex_lock(&mu);
  *p = next_dev;
  next_dev += ((len + 0xfffff) & ~0xfffffull) + (1 << 20);
  pthread_mutex_unlock(&mu);
  return OK;
}
CUresult cuMemAddressFree(CUdeviceptr p, size_t len) { (void)p; (void)len; return OK; }
CUresult cuMemMap(CUdeviceptr p, size_t len, size_t offset, unsigned long long h, unsigned long long flags) {
  (void)flags;
  pthread_mutex_lock(&mu);
  if (h == 0 || h >= MAX_HANDLES || !handles[h].refs || offset != 0 || len > handles[h].len) {
    pthread_mutex_unlock(&mu);
    return ERR_INVALID_VALUE;
  }
  unsigned char *m = map_file(handles[h].fd, len);
  CUdeviceptr out;
  CUresult r = m ? add_alloc(m, len, VMM, -1, (int)h, p, &out) : ERR_OUT_OF_MEMORY;
  if (r == OK) handles[h].refs++;
  pthread_mutex_unlock(&mu);
  return r;
}
CUresult cuMemSetAccess(CUdeviceptr p, size_t len, const void *desc, size_t count) {
  (void)desc;
  pthread_mutex_lock(&mu);
  int i = find_alloc(p, len);
  pthread_mutex_unlock(&mu);
  return i >= 0 && count == 1 ? OK : ERR_INVALID_VALUE;
}
CUresult cuMemUnmap(CUdeviceptr p, size_t len) {
  pthread_mutex_lock(&mu);
  for (int i = 0; i < MAX_STREAMS; i++) if (streams[i]) flush(streams[i]);
  for (int i = 0; i < MAX_ALLOCS; i++) {
    if (allocs[i].host && allocs[i].dev == p && allocs[i].len == len && allocs[i].kind == VMM) {
      int h = allocs[i].handle;
      drop_alloc(i);
      if (--handles[h].refs == 0) close(handles[h].fd);
      pthread_mutex_unlock(&mu);
      return OK;
    }
  }
  pthread_mutex_unlock(&mu);
  return ERR_INVALID_VALUE;
}
CUresult cuMemRetainAllocationHandle(unsigned long long *h, void *addr) {
  pthread_mutex_lock(&mu);
  int i = find_alloc((CUdeviceptr)addr, 1);
  if (i < 0 || allocs[i].kind != VMM) { pthread_mutex_unlock(&mu); return ERR_INVALID_VALUE; }
  *h = allocs[i].handle;
  handles[*h].refs++;
  pthread_mutex_unlock(&mu);
  return OK;
}
CUresult cuMemExportToShareableHandle(void *out, unsigned long long h, int type, unsigned long long flags) {
  (void)flags;
  if (type != 1 /* POSIX_FILE_DESCRIPTOR */ || h == 0 || h >= MAX_HANDLES || !handles[h].refs)
    return ERR_INVALID_VALUE;
  int fd = fcntl(handles[h].fd, F_DUPFD_CLOEXEC, 0);
  if (fd < 0) return ERR_OUT_OF_MEMORY;
  *(int *)out = fd;
  return OK;
}
CUresult cuMemImportFromShareableHandle(unsigned long long *h, void *os, int type) {
  if (type != 1) return ERR_INVALID_VALUE;
  int fd = fcntl((int)(long)os, F_DUPFD_CLOEXEC, 0);
  struct stat st;
  if (fd < 0 || fstat(fd, &st) != 0) { if (fd >= 0) close(fd); return ERR_INVALID_VALUE; }
  pthread_mutex_lock(&mu);
  int i = new_handle(fd, (size_t)st.st_size);
  pthread_mutex_unlock(&mu);
  if (!i) { close(fd); return ERR_OUT_OF_MEMORY; }
  *h = i;
  return OK;
}

CUresult cuGetErrorString(CUresult e, const char **s) { (void)e; *s = "fake libcuda error"; return OK; }
CUresult cuGetErrorName(CUresult e, const char **s) { (void)e; *s = "CUDA_ERROR_FAKE"; return OK; }
