/* A fake CUDA driver for testing kvxfer's CUDA code on machines without a GPU: one device
 * whose memory the host cannot dereference (device pointers lie outside any user address
 * space; copies translate them), and streams whose asynchronous copies are *deferred* until
 * the stream is synchronized, so that a missing synchronization corrupts data and fails a
 * test instead of passing by luck. Pinned registrations are checked (unregistering memory
 * that was not registered, or a copy into an unregistered range counted as pageable, are
 * reported). Built by tests/fake_cuda.rs; see stubs.c for the symbols it does not model. */
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

/* Device memory: allocations at DEV_BASE + offset, backed by host memory nobody else sees. */
#define DEV_BASE 0x7d00000000000000ull
#define MAX_ALLOCS 4096
static struct { CUdeviceptr dev; unsigned char *host; size_t len; } allocs[MAX_ALLOCS];
static CUdeviceptr next_dev = DEV_BASE;

static unsigned char *translate(CUdeviceptr p, size_t len) {
  for (int i = 0; i < MAX_ALLOCS; i++) {
    if (allocs[i].host && p >= allocs[i].dev && p + len <= allocs[i].dev + allocs[i].len)
      return allocs[i].host + (p - allocs[i].dev);
  }
  fprintf(stderr, "fake libcuda: device range [%#llx, +%zu) is not allocated\n", p, len);
  abort();
}

/* Deferred copies. */
enum { H2D, D2H, SET };
struct op { int kind; void *host; CUdeviceptr dev; size_t len; unsigned char value; struct op *next; };
struct stream_s { struct op *head, *tail; CUcontext ctx; };

static void run(struct op *o) {
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
CUresult cuDeviceGetAttribute(int *v, int attr, CUdevice d) { (void)attr; (void)d; *v = 0; return OK; }
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

CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t len) {
  if (!current) return ERR_INVALID_CONTEXT;
  pthread_mutex_lock(&mu);
  for (int i = 0; i < MAX_ALLOCS; i++) {
    if (!allocs[i].host) {
      allocs[i].host = calloc(1, len ? len : 1);
      if (!allocs[i].host) { pthread_mutex_unlock(&mu); return ERR_OUT_OF_MEMORY; }
      allocs[i].dev = next_dev;
      allocs[i].len = len;
      next_dev += (len + 0xfffff) & ~0xfffffull;
      next_dev += 1 << 20; /* a guard gap */
      *p = allocs[i].dev;
      pthread_mutex_unlock(&mu);
      return OK;
    }
  }
  pthread_mutex_unlock(&mu);
  return ERR_OUT_OF_MEMORY;
}
CUresult cuMemAllocAsync(CUdeviceptr *p, size_t len, CUstream s) { (void)s; return cuMemAlloc_v2(p, len); }
CUresult cuMemFree_v2(CUdeviceptr p) {
  pthread_mutex_lock(&mu);
  for (int i = 0; i < MAX_STREAMS; i++) if (streams[i]) flush(streams[i]);
  for (int i = 0; i < MAX_ALLOCS; i++) {
    if (allocs[i].host && allocs[i].dev == p) {
      free(allocs[i].host);
      allocs[i].host = NULL;
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
#define MAX_PINS 256
static void *pins[MAX_PINS];
CUresult cuMemHostRegister_v2(void *p, size_t len, unsigned flags) {
  (void)len; (void)flags;
  if (!current) return ERR_INVALID_CONTEXT;
  pthread_mutex_lock(&mu);
  for (int i = 0; i < MAX_PINS; i++) if (!pins[i]) { pins[i] = p; break; }
  pthread_mutex_unlock(&mu);
  return OK;
}
CUresult cuMemHostUnregister(void *p) {
  pthread_mutex_lock(&mu);
  for (int i = 0; i < MAX_PINS; i++) {
    if (pins[i] == p) { pins[i] = NULL; pthread_mutex_unlock(&mu); return OK; }
  }
  pthread_mutex_unlock(&mu);
  fprintf(stderr, "fake libcuda: cuMemHostUnregister of unregistered %p\n", p);
  return ERR_INVALID_VALUE;
}

CUresult cuGetErrorString(CUresult e, const char **s) { (void)e; *s = "fake libcuda error"; return OK; }
CUresult cuGetErrorName(CUresult e, const char **s) { (void)e; *s = "CUDA_ERROR_FAKE"; return OK; }
