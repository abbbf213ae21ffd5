/* The C test of libkvxfer: two agents in two processes (fork) move data both ways over the
 * transport given in argv[1], check every byte, hand a request over through the connector,
 * and exercise error paths through status codes and the last-error message. */
#include <kvxfer.h>

#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#define LEN (4u << 20)
#define BLOCK 4096u
#define N 256u

static void die(const char *what, kvx_status s) {
  char msg[512];
  kvx_last_error(msg, sizeof msg);
  fprintf(stderr, "[%d] %s: %s (%u): %s\n", (int)getpid(), what, kvx_status_name(s), (unsigned)s, msg);
  exit(1);
}
#define CHECK(call)                    \
  do {                                 \
    kvx_status s_ = (call);            \
    if (s_ != KVX_OK) die(#call, s_); \
  } while (0)
#define EXPECT(call, want)                                                                 \
  do {                                                                                     \
    kvx_status s_ = (call);                                                                \
    char m_[512];                                                                          \
    if (s_ != (want)) die(#call " (expected " #want ")", s_);                              \
    if (kvx_last_error(m_, sizeof m_) == 0) die(#call ": no last-error message", s_);     \
  } while (0)

/* Sockets this process has open. */
static int sockets(void) {
  int n = 0;
  DIR *d = opendir("/proc/self/fd");
  struct dirent *e;
  char path[300], target[64];
  if (!d) return -1;
  while ((e = readdir(d)) != NULL) {
    snprintf(path, sizeof path, "/proc/self/fd/%s", e->d_name);
    ssize_t k = readlink(path, target, sizeof target - 1);
    if (k > 0 && (target[k] = 0, strncmp(target, "socket:", 7) == 0)) n++;
  }
  closedir(d);
  return n;
}

static unsigned char pattern(unsigned who, size_t i) { return (unsigned char)(i * 31u + who * 7u + (i >> 12)); }

/* Waits for a notification and checks its payload. */
static void expect_note(kvx_agent *a, const char *want) {
  static char from[KVX_MAX_NAME + 1];
  static unsigned char payload[KVX_MAX_NOTIFICATION];
  size_t n = 0;
  CHECK(kvx_agent_next_notification(a, 20000, from, sizeof from, payload, sizeof payload, &n));
  if (n != strlen(want) || memcmp(payload, want, n) != 0) {
    fprintf(stderr, "notification %.*s, expected %s\n", (int)n, (const char *)payload, want);
    exit(1);
  }
}

static void fill_descs(kvx_desc *d, uint32_t region, int reverse) {
  for (unsigned k = 0; k < N; k++) {
    unsigned slot = reverse ? (N - 1 - k) * 2 : k * 2; /* scattered: every other block */
    d[k].region = region;
    d[k].offset = (uint64_t)slot * BLOCK;
    d[k].len = BLOCK;
  }
}

/* Connector layout: 2 layers, 2 heads, dim 64, bf16, 16-token blocks, fused K/V. */
static kvx_layout layout(uint64_t blocks) {
  kvx_layout l = {.layers = 2, .kv_heads = 2, .head_dim = 64, .dtype_bytes = 2, .block_tokens = 16,
                  .num_blocks = blocks, .packing = KVX_PACKING_FUSED, .hnd = 0};
  return l;
}
#define CBLOCK (2u * 16u * 2u * 64u * 2u) /* fused block bytes */

/* Both ends are built with the config builder and share a secret: the side channel must
 * prove it both ways before metadata moves. */
static const char SECRET[] = "c-test-secret";

static kvx_agent *agent_with(const char *name, const char *transport) {
  kvx_agent_config *c = NULL;
  CHECK(kvx_agent_config_new(name, &c));
  CHECK(kvx_agent_config_set_transport(c, transport));
  CHECK(kvx_agent_config_set_net_devices(c, "lo"));
  CHECK(kvx_agent_config_set_secret(c, (const uint8_t *)SECRET, sizeof SECRET - 1));
  CHECK(kvx_agent_config_set_gpu_path(c, "staged"));
  CHECK(kvx_agent_config_set_staging(c, 4, 1 << 20));
  CHECK(kvx_agent_config_set_budget(c, 1ull << 30));
  kvx_agent *a = NULL;
  CHECK(kvx_agent_new_with(c, &a));
  kvx_agent_config_free(c);
  return a;
}

static int child(const char *transport, int to_parent, int from_parent) {
  kvx_agent *b = agent_with("c-child", transport);
  kvx_region *r = NULL;
  CHECK(kvx_agent_alloc(b, LEN, &r));
  kvx_region *cr = NULL;
  CHECK(kvx_agent_alloc(b, 2 * 8 * CBLOCK, &cr));
  char addr[128];
  size_t alen = 0;
  /* A buffer too small: refused before binding, three times, and no socket is left open. */
  int before = sockets();
  for (int i = 0; i < 3; i++) {
    EXPECT(kvx_agent_listen(b, "127.0.0.1:0", addr, 8, &alen), KVX_BUFFER_TOO_SMALL);
    if (alen != KVX_MAX_ADDRESS) die("listen: room needed", KVX_OK);
  }
  if (sockets() != before) die("a failed kvx_agent_listen left a socket", KVX_OK);
  CHECK(kvx_agent_listen(b, "localhost:0", addr, sizeof addr, &alen)); /* a host name works */
  if (addr[alen] != 0 || strlen(addr) != alen) die("listen: address not NUL-terminated", KVX_OK);
  uint32_t ids[2] = {kvx_region_id(r), kvx_region_id(cr)};
  write(to_parent, &alen, sizeof alen);
  write(to_parent, addr, alen);
  write(to_parent, ids, sizeof ids);

  kvx_layer_base bases[2];
  for (int l = 0; l < 2; l++) {
    bases[l].k_region = kvx_region_id(cr);
    bases[l].k_offset = (uint64_t)l * 8 * CBLOCK;
    bases[l].v_region = UINT32_MAX;
    bases[l].v_offset = 0;
  }
  kvx_layout lay = layout(8);
  kvx_connector_config cfg = {0};
  cfg.heartbeat_ms = 50;
  kvx_consumer *cons = NULL;
  CHECK(kvx_consumer_new(b, &lay, bases, &cfg, &cons));

  /* 1. The parent WRITEs into our region; its notification arrives after the data. */
  expect_note(b, "written");
  unsigned char *mem = kvx_region_ptr(r);
  for (unsigned k = 0; k < N; k++) {
    size_t dst = (size_t)k * 2 * BLOCK, src = (size_t)(N - 1 - k) * 2 * BLOCK;
    for (size_t i = 0; i < BLOCK; i++)
      if (mem[dst + i] != pattern(1, src + i)) {
        fprintf(stderr, "child: byte %zu of block %u differs\n", i, k);
        return 1;
      }
  }
  /* 2. Fill our odd blocks for the parent to READ. */
  for (size_t i = 0; i < LEN; i++) mem[i] = pattern(2, i);
  CHECK(kvx_agent_notify(b, "c-parent", (const unsigned char *)"ready", 5));
  expect_note(b, "read-done");

  /* 3. Load a request through the connector: 3 blocks of which we hold the first. */
  size_t hlen = 0;
  read(from_parent, &hlen, sizeof hlen);
  unsigned char *h = malloc(hlen);
  read(from_parent, h, hlen);
  uint32_t local[2] = {6, 4};
  CHECK(kvx_consumer_start_load(cons, h, hlen, local, 2));
  CHECK(kvx_consumer_wait(cons, "req-1", 20000));
  char name[64];
  size_t nlen = 0;
  kvx_request_stats st;
  CHECK(kvx_consumer_next_finished(cons, name, sizeof name, &nlen, &st));
  if (st.bytes_moved != 2u * 2u * CBLOCK || st.bytes_skipped != 1u * 2u * CBLOCK) {
    fprintf(stderr, "child: moved %llu skipped %llu\n", (unsigned long long)st.bytes_moved,
            (unsigned long long)st.bytes_skipped);
    return 1;
  }
  unsigned char *cm = kvx_region_ptr(cr);
  uint32_t remote[3] = {5, 2, 7};
  for (int l = 0; l < 2; l++)
    for (int k = 1; k < 3; k++)
      for (size_t i = 0; i < CBLOCK; i++) {
        size_t got = (size_t)l * 8 * CBLOCK + local[k - 1] * CBLOCK + i;
        size_t want = (size_t)l * 8 * CBLOCK + remote[k] * CBLOCK + i;
        if (cm[got] != pattern(3, want)) {
          fprintf(stderr, "child: connector byte differs (layer %d block %d)\n", l, k);
          return 1;
        }
      }
  char metrics[8192];
  size_t mlen = 0;
  CHECK(kvx_consumer_metrics(cons, metrics, sizeof metrics, &mlen));
  if (!strstr(metrics, "kvxfer_requests_total{role=\"consumer\",result=\"ok\"} 1")) {
    fprintf(stderr, "child: metrics: %.*s\n", (int)mlen, metrics);
    return 1;
  }
  CHECK(kvx_agent_notify(b, "c-parent", (const unsigned char *)"loaded", 6));
  expect_note(b, "bye");
  free(h);
  kvx_consumer_free(cons);
  CHECK(kvx_agent_deregister(b, r));
  kvx_region_free(r);
  kvx_region_free(cr);
  kvx_agent_free(b);
  return 0;
}

/* The in-process connector: a second implementation of the connector traits, reached with
 * the same kvx_producer_* / kvx_consumer_* calls, no new bindings: memcpy between two caches
 * of this process. A prefix of one block is cached on the decode side. */
static void in_process(void) {
  kvx_connector *ip = NULL;
  CHECK(kvx_connector_in_process(&ip));
  kvx_layout lay = layout(8);
  unsigned char *src = calloc(2, 8 * CBLOCK), *dst = calloc(2, 8 * CBLOCK);
  if (!src || !dst) die("calloc", KVX_OK);
  for (size_t i = 0; i < 2 * 8 * CBLOCK; i++) src[i] = pattern(4, i);
  kvx_cache_tensor ts[2], td[2];
  for (int k = 0; k < 2; k++) {
    ts[k] = (kvx_cache_tensor){.k = src + (size_t)k * 8 * CBLOCK, .k_len = 8 * CBLOCK};
    td[k] = (kvx_cache_tensor){.k = dst + (size_t)k * 8 * CBLOCK, .k_len = 8 * CBLOCK};
  }
  kvx_connector_config cfg = {0};
  cfg.heartbeat_ms = 20;
  kvx_producer *p = NULL;
  kvx_consumer *c = NULL;
  CHECK(kvx_connector_producer(ip, &lay, ts, -1, &cfg, &p));
  CHECK(kvx_connector_consumer(ip, &lay, td, -1, &cfg, &c));
  /* A tensor too small for its blocks is refused with a message. */
  kvx_cache_tensor bad[2] = {ts[0], ts[1]};
  bad[1].k_len = CBLOCK;
  kvx_producer *nop = NULL;
  EXPECT(kvx_connector_producer(ip, &lay, bad, -1, NULL, &nop), KVX_INVALID_ARGUMENT);
  /* Packing is checked: a value past KVX_PACKING_STATE, and a state layout of token blocks,
   * hash to 0 (refused); a state page's hash does not depend on its split units. */
  kvx_layer_base lb[2] = {{.k_region = 0, .v_region = UINT32_MAX},
                          {.k_region = 0, .k_offset = 8 * CBLOCK, .v_region = UINT32_MAX}};
  kvx_layout odd = lay;
  odd.packing = 4;
  if (kvx_layout_compat_hash(&odd, lb) != 0) die("packing 4 hashed", KVX_OK);
  kvx_layout st4 = {.layers = 2, .kv_heads = 4, .head_dim = 96, .dtype_bytes = 2,
                    .block_tokens = 1, .num_blocks = 8, .packing = KVX_PACKING_STATE, .hnd = 0};
  kvx_layout st2 = st4;
  st2.kv_heads = 2;
  uint64_t h4 = kvx_layout_compat_hash(&st4, lb), h2 = kvx_layout_compat_hash(&st2, lb);
  if (h4 == 0 || h4 != h2) die("state layout hash", KVX_OK);
  st2.block_tokens = 16;
  if (kvx_layout_compat_hash(&st2, lb) != 0) die("a state layout of 16-token blocks hashed", KVX_OK);
  uint32_t blocks[3] = {1, 3, 5}, local[2] = {6, 0};
  unsigned char h[4096];
  size_t hlen = 0;
  CHECK(kvx_producer_publish(p, "ip-1", blocks, 3, 48, 2, h, sizeof h, &hlen));
  CHECK(kvx_consumer_start_load_with(c, h, hlen, local, 2, NULL)); /* NULL: as start_load */
  CHECK(kvx_consumer_wait(c, "ip-1", 20000));
  for (int k = 0; k < 2; k++)
    for (int j = 0; j < 2; j++) {
      const unsigned char *want = src + (size_t)k * 8 * CBLOCK + (size_t)blocks[j + 1] * CBLOCK;
      const unsigned char *got = dst + (size_t)k * 8 * CBLOCK + (size_t)local[j] * CBLOCK;
      if (memcmp(want, got, CBLOCK) != 0) die("in-process bytes", KVX_OK);
    }
  char name[64];
  size_t nlen = 0;
  kvx_request_stats st;
  /* A buffer too small keeps the finished load for the next call. */
  EXPECT(kvx_consumer_next_finished(c, name, 2, &nlen, &st), KVX_NOT_FOUND);
  CHECK(kvx_consumer_next_finished(c, name, sizeof name, &nlen, &st));
  if (nlen != 4 || memcmp(name, "ip-1", 4) != 0 || st.bytes_moved != 2ull * 2 * CBLOCK ||
      st.bytes_skipped != 2ull * CBLOCK)
    die("in-process figures", KVX_OK);
  uint32_t fb[8];
  size_t nb = 0;
  uint32_t reason = 99;
  EXPECT(kvx_producer_next_freed(p, 20000, name, sizeof name, &nlen, fb, 1, &nb, &reason),
         KVX_BUFFER_TOO_SMALL);
  if (nb != 3) die("freed size report", KVX_OK);
  CHECK(kvx_producer_next_freed(p, 0, name, sizeof name, &nlen, fb, 8, &nb, &reason));
  if (nb != 3 || reason != 0 || fb[0] != 1) die("in-process freed", KVX_OK);
  kvx_consumer_free(c);
  kvx_producer_free(p);
  kvx_connector_free(ip);
  free(src);
  free(dst);
  printf("in-process connector: 2 of 3 blocks moved (1 cached), bytes verified, freed on ack\n");
}

/* Tensor parallelism: what a decode rank loads from which prefill rank, and a geometry that
 * cannot work refused naming both sides. */
static void tp_plan(void) {
  kvx_tp_read r[4];
  size_t n = 0;
  CHECK(kvx_tp_plan(2, 4, 1, 4, 0, r, 4, &n));
  if (n != 2 || r[0].producer_rank != 0 || r[1].producer_rank != 1 || r[1].readers != 1 ||
      r[1].remote_heads_start != 0 || r[1].remote_heads_end != 2 || r[1].local_heads_start != 2 ||
      r[1].local_heads_end != 4)
    die("tp plan 2 -> 1", KVX_OK);
  EXPECT(kvx_tp_plan(2, 4, 1, 4, 0, r, 1, &n), KVX_BUFFER_TOO_SMALL);
  if (n != 2) die("tp plan size report", KVX_OK);
  CHECK(kvx_tp_plan(1, 4, 2, 4, 1, r, 4, &n));
  if (n != 1 || r[0].readers != 2 || r[0].remote_heads_start != 2 || r[0].local_heads_start != 0)
    die("tp plan 1 -> 2", KVX_OK);
  EXPECT(kvx_tp_plan(2, 6, 4, 6, 0, r, 4, &n), KVX_INVALID_ARGUMENT);
  char m[512];
  kvx_last_error(m, sizeof m);
  if (!strstr(m, "prefill TP 2 over 6 KV heads") || !strstr(m, "decode TP 4 over 6 KV heads"))
    die("tp refusal does not name both sides", KVX_OK);
  printf("tp plan: 2 -> 1 reads both halves into place, 1 -> 2 declares 2 readers, 6 heads over TP 4 refused\n");
}

/* `kvx_test <transport> serve`: a process that moves blocks until it is asked to stop, then
 * stops in order: a SIGTERM gives the transfer in flight 500 ms, SIGINT (or a second
 * SIGTERM) cancels it at once; every handle is freed, nothing of kvxfer is left
 * (kvx_live), and the process exits 0. */
static int serve_until_stopped(const char *transport) {
  kvx_stop_signals_install();
  kvx_agent *a = NULL, *b = NULL;
  kvx_region *ra = NULL, *rb = NULL;
  char addr[KVX_MAX_ADDRESS], name[KVX_MAX_NAME + 1];
  size_t alen = 0, nlen = 0;
  CHECK(kvx_agent_new("c-serve-a", transport, "lo", 0, &a));
  CHECK(kvx_agent_new("c-serve-b", transport, "lo", 0, &b));
  CHECK(kvx_agent_alloc(a, LEN, &ra));
  CHECK(kvx_agent_alloc(b, LEN, &rb));
  CHECK(kvx_agent_listen(b, "127.0.0.1:0", addr, sizeof addr, &alen));
  CHECK(kvx_agent_connect(a, addr, name, sizeof name, &nlen));
  kvx_desc ld[N], rd[N];
  fill_descs(ld, kvx_region_id(ra), 0);
  fill_descs(rd, kvx_region_id(rb), 0);
  kvx_local_list *l = NULL;
  kvx_remote_list *rl = NULL;
  CHECK(kvx_agent_prep_local(a, ld, N, &l));
  CHECK(kvx_agent_prep_remote(a, name, rd, N, &rl));
  printf("serving\n");
  fflush(stdout);
  unsigned long done = 0;
  int canceled = 0;
  while (!kvx_stop_requested()) {
    kvx_transfer *t = NULL;
    CHECK(kvx_agent_transfer(a, KVX_WRITE, l, NULL, rl, NULL, N, NULL, 0, 0, &t));
    int waited_ms = 0, stopping_ms = -1;
    kvx_status s;
    while ((s = kvx_transfer_wait(t, 20, NULL)) == KVX_TIMEOUT) {
      waited_ms += 20;
      if (kvx_stop_requested() && stopping_ms < 0) stopping_ms = waited_ms;
      if (kvx_stop_requested() == 2 || (stopping_ms >= 0 && waited_ms - stopping_ms >= 500)) {
        s = kvx_transfer_cancel(t);
        canceled = s == KVX_CANCELED;
        break;
      }
    }
    if (s != KVX_OK && s != KVX_CANCELED) die("a transfer while serving", s);
    kvx_transfer_free(t);
    done++;
  }
  kvx_local_list_free(l);
  kvx_remote_list_free(rl);
  CHECK(kvx_agent_deregister(a, ra));
  CHECK(kvx_agent_deregister(b, rb));
  kvx_region_free(ra);
  kvx_region_free(rb);
  kvx_agent_free(a);
  kvx_agent_free(b);
  size_t live[4] = {1, 1, 1, 1};
  CHECK(kvx_live(&live[0], &live[1], &live[2], &live[3]));
  printf("kvx_test serve: stopped (%s) after %lu transfers%s; left: %zu agents, %zu regions, %zu UCX "
         "registrations, %zu peer mappings\n",
         kvx_stop_requested() == 2 ? "cancel" : "grace", done, canceled ? ", the last cancelled" : "", live[0],
         live[1], live[2], live[3]);
  return live[0] + live[1] + live[2] + live[3] == 0 ? 0 : 1;
}

int main(int argc, char **argv) {
  const char *transport = argc > 1 ? argv[1] : "tcp";
  if (argc > 2 && strcmp(argv[2], "serve") == 0) return serve_until_stopped(transport);
  int up[2], down[2];
  if (pipe(up) || pipe(down)) return 1;
  pid_t pid = fork();
  if (pid == 0) {
    close(up[0]);
    close(down[1]);
    _exit(child(transport, up[1], down[0]));
  }
  close(up[1]);
  close(down[0]);

  /* Error paths first: NULLs, bad arguments, garbage metadata. */
  kvx_agent *bad = NULL;
  EXPECT(kvx_agent_new(NULL, "tcp", NULL, 0, &bad), KVX_NULL_PARAMETER);
  EXPECT(kvx_agent_new("", "tcp", NULL, 0, &bad), KVX_INVALID_ARGUMENT);
  setenv("KVXFER_GPU_PATH", "sideways", 1);
  EXPECT(kvx_agent_new("c-gpu", "tcp", "lo", 0, &bad), KVX_INVALID_ARGUMENT);
  {
    char m[512];
    kvx_last_error(m, sizeof m);
    if (strstr(m, "KVXFER_GPU_PATH") == NULL) die("last error does not name KVXFER_GPU_PATH", KVX_OK);
  }
  unsetenv("KVXFER_GPU_PATH");
  /* A success clears the last error: a message read now is never an older call's. */
  {
    kvx_agent_config *okc = NULL;
    if (kvx_last_error(NULL, 0) == 0) die("a failure left no message", KVX_OK);
    {
      /* A short buffer gets a truncated, terminated message and nothing past its end. */
      char tiny[8];
      size_t full = kvx_last_error(tiny, sizeof tiny);
      if (full <= sizeof tiny || strlen(tiny) != sizeof tiny - 1) die("last error not truncated", KVX_OK);
    }
    CHECK(kvx_agent_config_new("c-clear", &okc));
    if (kvx_last_error(NULL, 0) != 0) die("last error kept after a success", KVX_OK);
    kvx_agent_config_free(okc);
  }
  if (bad != NULL) die("output written on failure", KVX_OK);
  /* kvx_agent_new stays for existing callers. */
  CHECK(kvx_agent_new("c-legacy", transport, "lo", 0, &bad));
  kvx_agent_free(bad);
  bad = NULL;
  /* The config builder: bad settings are refused with a reason and leave the config usable. */
  {
    kvx_agent_config *c = NULL;
    EXPECT(kvx_agent_config_new(NULL, &c), KVX_NULL_PARAMETER);
    CHECK(kvx_agent_config_new("c-config", &c));
    EXPECT(kvx_agent_config_set_gpu_path(c, "sideways"), KVX_INVALID_ARGUMENT);
    char m[512];
    kvx_last_error(m, sizeof m);
    if (strstr(m, "sideways") == NULL) die("last error does not name the gpu path", KVX_OK);
    EXPECT(kvx_agent_config_set_staging(c, 1, 4096), KVX_INVALID_ARGUMENT);
    EXPECT(kvx_agent_config_set_compression(c, "maybe"), KVX_INVALID_ARGUMENT);
    kvx_last_error(m, sizeof m);
    if (strstr(m, "maybe") == NULL) die("last error does not name the compression mode", KVX_OK);
    EXPECT(kvx_agent_config_set_link_rate(c, "peer", -1.0), KVX_INVALID_ARGUMENT);
    EXPECT(kvx_agent_config_set_max_peers(c, 0), KVX_INVALID_ARGUMENT);
    CHECK(kvx_agent_config_set_max_peers(c, 64));
    CHECK(kvx_agent_config_set_peer_idle(c, 5000));
    CHECK(kvx_agent_config_set_deregister_wait(c, 2000));
    if (strcmp(kvx_status_name(KVX_PEER_LIMIT), "KVX_PEER_LIMIT") != 0)
      die("KVX_PEER_LIMIT has no name", KVX_OK);
    CHECK(kvx_agent_config_set_compression(c, "auto"));
    CHECK(kvx_agent_config_set_link_rate(c, "peer", 125e6));
    EXPECT(kvx_agent_config_set_transport(c, NULL), KVX_NULL_PARAMETER);
    EXPECT(kvx_agent_config_set_strict(NULL, 1), KVX_NULL_PARAMETER);
    EXPECT(kvx_agent_new_with(c, NULL), KVX_NULL_PARAMETER);
    CHECK(kvx_agent_config_set_transport(c, transport));
    CHECK(kvx_agent_config_set_strict(c, 0));
    CHECK(kvx_agent_config_set_lanes(c, 1));
    CHECK(kvx_agent_config_set_ucx(c, "RNDV_THRESH", "auto"));
    CHECK(kvx_agent_config_set_net_devices(c, NULL));
    CHECK(kvx_agent_new_with(c, &bad));
    kvx_agent_free(bad);
    bad = NULL;
    kvx_agent_config_free(c);
    kvx_agent_config_free(NULL);
  }

  kvx_agent *a = agent_with("c-parent", transport);
  char name[KVX_MAX_NAME + 1];
  size_t nlen = 0;
  unsigned char garbage[64];
  memset(garbage, 0xab, sizeof garbage);
  EXPECT(kvx_agent_load_metadata(a, garbage, sizeof garbage, name, sizeof name, &nlen), KVX_METADATA);
  unsigned char small[4];
  size_t need = 0;
  EXPECT(kvx_agent_metadata(a, small, sizeof small, &need), KVX_BUFFER_TOO_SMALL);
  if (need <= sizeof small) die("needed size not reported", KVX_OK);
  char msg[256];
  kvx_last_error(msg, sizeof msg);
  printf("last error, as a user sees it: %s\n", msg);

  kvx_region *r = NULL;
  /* Device memory where this library (no `cuda` feature, or no GPU) cannot handle it. */
  {
    static unsigned char not_vram[4096];
    kvx_region *dr = NULL;
    EXPECT(kvx_agent_register(a, not_vram, sizeof not_vram, 0, &dr), KVX_CUDA);
    if (dr != NULL) die("region written on failure", KVX_OK);
  }
  CHECK(kvx_agent_alloc(a, LEN, &r));
  unsigned char *mem = kvx_region_ptr(r);
  for (size_t i = 0; i < LEN; i++) mem[i] = pattern(1, i);

  size_t alen = 0;
  char addr[128];
  uint32_t ids[2];
  read(up[0], &alen, sizeof alen);
  read(up[0], addr, alen);
  addr[alen] = 0;
  read(up[0], ids, sizeof ids);
  /* Too small for any name: refused before connecting, the size needed reported. */
  EXPECT(kvx_agent_connect(a, addr, name, 8, &nlen), KVX_BUFFER_TOO_SMALL);
  if (nlen != KVX_MAX_NAME + 1) die("connect: room needed", KVX_OK);
  CHECK(kvx_agent_connect(a, addr, name, sizeof name, &nlen));
  if (name[nlen] != 0 || strlen(name) != nlen) die("connect: name not NUL-terminated", KVX_OK);
  {
    kvx_gpu_path gp = KVX_GPU_STAGED;
    CHECK(kvx_agent_peer_gpu_path(a, name, &gp));
    if (gp != KVX_GPU_NONE) die("host-only peers report a GPU path", KVX_OK);
    EXPECT(kvx_agent_peer_gpu_path(a, "nobody", &gp), KVX_UNKNOWN_PEER);
    /* The peer's region ids from its metadata: the same the child sent over the pipe. */
    uint32_t pid_[4];
    uint64_t plen[4];
    size_t np = 0;
    EXPECT(kvx_agent_peer_regions(a, name, pid_, plen, 1, &np), KVX_BUFFER_TOO_SMALL);
    if (np != 2) die("peer regions: count", KVX_OK);
    CHECK(kvx_agent_peer_regions(a, name, pid_, plen, 4, &np));
    if (np != 2 || pid_[0] != ids[0] || pid_[1] != ids[1] || plen[1] != 2 * 8 * CBLOCK)
      die("peer regions: ids or lengths", KVX_OK);
    EXPECT(kvx_agent_peer_regions(a, "nobody", pid_, plen, 4, &np), KVX_UNKNOWN_PEER);
  }

  kvx_desc ld[N], rd[N];
  fill_descs(ld, kvx_region_id(r), 1);
  fill_descs(rd, ids[0], 0);
  kvx_local_list *l = NULL;
  kvx_remote_list *rl = NULL;
  CHECK(kvx_agent_prep_local(a, ld, N, &l));
  CHECK(kvx_agent_prep_remote(a, name, rd, N, &rl));

  /* An out-of-range remote descriptor is refused before anything moves. */
  kvx_desc oob = {.region = ids[0], .offset = LEN - 8, .len = 16};
  kvx_remote_list *bad_list = NULL;
  EXPECT(kvx_agent_prep_remote(a, name, &oob, 1, &bad_list), KVX_OUT_OF_BOUNDS);
  EXPECT(kvx_agent_prep_remote(a, "nobody", rd, 1, &bad_list), KVX_UNKNOWN_PEER);
  EXPECT(kvx_agent_transfer(a, KVX_WRITE, l, NULL, NULL, NULL, N, NULL, 0, 0, NULL), KVX_NULL_PARAMETER);

  /* 1. WRITE with a notification, poll until done. */
  kvx_transfer *t = NULL;
  CHECK(kvx_agent_transfer(a, KVX_WRITE, l, NULL, rl, NULL, N, (const unsigned char *)"written", 7, 30000, &t));
  kvx_xfer_stats st;
  kvx_status s;
  while ((s = kvx_transfer_poll(t, &st)) == KVX_IN_PROGRESS) usleep(100);
  if (s != KVX_OK) die("write", s);
  if (st.bytes != (uint64_t)N * BLOCK) die("write bytes", KVX_OK);
  if (kvx_transfer_poll(t, NULL) != KVX_OK) die("poll is not repeatable", KVX_OK);
  kvx_transfer_free(t);
  printf("write: %llu bytes, %llu ops, lane %u, %.3f ms\n", (unsigned long long)st.bytes,
         (unsigned long long)st.ops, st.lane, st.duration_ns / 1e6);

  /* 2. READ the child's odd blocks back into our odd blocks. */
  expect_note(a, "ready");
  for (unsigned k = 0; k < N; k++) {
    ld[k].offset = (uint64_t)(k * 2 + 1) * BLOCK;
    rd[k].offset = (uint64_t)(k * 2 + 1) * BLOCK;
  }
  kvx_local_list *l2 = NULL;
  kvx_remote_list *r2 = NULL;
  CHECK(kvx_agent_prep_local(a, ld, N, &l2));
  CHECK(kvx_agent_prep_remote(a, name, rd, N, &r2));
  CHECK(kvx_agent_transfer(a, KVX_READ, l2, NULL, r2, NULL, N, (const unsigned char *)"read-done", 9, 30000, &t));
  CHECK(kvx_transfer_wait(t, 30000, &st));
  kvx_transfer_free(t);
  for (unsigned k = 0; k < N; k++) {
    size_t off = (size_t)(k * 2 + 1) * BLOCK;
    for (size_t i = 0; i < BLOCK; i++)
      if (mem[off + i] != pattern(2, off + i)) {
        fprintf(stderr, "parent: read byte %zu of block %u differs\n", i, k);
        return 1;
      }
  }
  printf("read: %llu bytes verified\n", (unsigned long long)st.bytes);

  /* 3. Hand a request over through the connector: 3 blocks, the child holds the first. */
  kvx_region *pr = NULL;
  CHECK(kvx_agent_alloc(a, 2 * 8 * CBLOCK, &pr));
  unsigned char *pm = kvx_region_ptr(pr);
  for (size_t i = 0; i < 2 * 8 * CBLOCK; i++) pm[i] = pattern(3, i);
  kvx_layer_base bases[2];
  for (int k = 0; k < 2; k++) {
    bases[k].k_region = kvx_region_id(pr);
    bases[k].k_offset = (uint64_t)k * 8 * CBLOCK;
    bases[k].v_region = UINT32_MAX;
    bases[k].v_offset = 0;
  }
  kvx_layout lay = layout(8);
  kvx_producer *prod = NULL;
  CHECK(kvx_agent_connect(a, addr, name, sizeof name, &nlen)); /* metadata with the new region */
  /* Through the trait path: a connector over the agent, the caches as tensors (inside the
   * registered region, so it is used as it is). */
  kvx_connector *conn = NULL;
  CHECK(kvx_connector_over_agent(a, NULL, &conn));
  kvx_cache_tensor tens[2];
  for (int k = 0; k < 2; k++) {
    tens[k].k = pm + (size_t)k * 8 * CBLOCK;
    tens[k].k_len = 8 * CBLOCK;
    tens[k].v = NULL;
    tens[k].v_len = 0;
  }
  (void)bases;
  CHECK(kvx_connector_producer(conn, &lay, tens, -1, NULL, &prod));
  kvx_connector_free(conn); /* the producer stays usable */
  uint32_t blocks[3] = {5, 2, 7};
  unsigned char h[4096];
  size_t hlen = 0;
  CHECK(kvx_producer_publish(prod, "req-1", blocks, 3, 48, 2, h, sizeof h, &hlen));
  write(down[1], &hlen, sizeof hlen);
  write(down[1], h, hlen);
  char freed[64];
  size_t flen = 0, nb = 0;
  uint32_t fb[8];
  uint32_t reason = 99;
  CHECK(kvx_producer_next_freed(prod, 20000, freed, sizeof freed, &flen, fb, 8, &nb, &reason));
  if (nb != 3 || reason != 0) die("freed blocks", KVX_OK);
  expect_note(a, "loaded");
  printf("connector: req-1 freed after the consumer's acknowledgement\n");

  /* Deregistering memory a list still names works; using the list then fails cleanly. */
  CHECK(kvx_agent_deregister(a, r));
  EXPECT(kvx_agent_deregister(a, r), KVX_DEREGISTERED);
  s = kvx_agent_transfer(a, KVX_WRITE, l, NULL, rl, NULL, N, NULL, 0, 0, &t);
  if (s == KVX_OK) {
    s = kvx_transfer_wait(t, 10000, NULL);
    kvx_transfer_free(t);
  }
  if (s != KVX_DEREGISTERED) die("transfer from deregistered memory", s);

  CHECK(kvx_agent_notify(a, name, (const unsigned char *)"bye", 3));
  int status = 1;
  waitpid(pid, &status, 0);
  kvx_producer_free(prod);
  kvx_local_list_free(l);
  kvx_local_list_free(l2);
  kvx_remote_list_free(rl);
  kvx_remote_list_free(r2);
  kvx_region_free(r);
  kvx_region_free(pr);
  /* Double free and use after free are refused, not undefined behaviour. */
  kvx_region_free(r);
  if (kvx_last_error(msg, sizeof msg) == 0 || !strstr(msg, "not live")) die("double free not reported", KVX_OK);
  EXPECT(kvx_agent_deregister(a, r), KVX_INVALID_HANDLE);
  if (kvx_region_id(r) != UINT32_MAX) die("region id of a freed handle", KVX_OK);
  kvx_agent_free(a);
  EXPECT(kvx_agent_metadata(a, small, sizeof small, &need), KVX_INVALID_HANDLE);
  kvx_agent_free(a);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    fprintf(stderr, "child failed\n");
    return 1;
  }
  in_process();
  tp_plan();
  {
    /* Discovery through etcd: an etcd that is not there (or a library built without the etcd
     * feature) is an error with a message, and writes no handle. */
    kvx_discovery *d = NULL;
    char m[512];
    if (kvx_discovery_etcd("http://127.0.0.1:1", "/kvx-c", 0, &d) == KVX_OK || d != NULL)
      die("kvx_discovery_etcd without an etcd", KVX_OK);
    if (kvx_last_error(m, sizeof m) != 0 && strstr(m, "etcd") == NULL) die("etcd error text", KVX_OK);
    printf("kvx_discovery_etcd without an etcd: %s\n", m);

    /* The same from the agent's configuration: a discovery URL that is not etcd's is refused
     * when set; an etcd that is not there (or a build without etcd) creates no agent; the
     * URL removed, the config makes an agent again. */
    kvx_agent_config *c = NULL;
    kvx_agent *ag = NULL;
    kvx_status st;
    if ((st = kvx_agent_config_new("c-disc", &c)) != KVX_OK) die("config", st);
    EXPECT(kvx_agent_config_set_discovery(c, "consul://x:1", "/kvx-c", 0), KVX_INVALID_ARGUMENT);
    if ((st = kvx_agent_config_set_discovery(c, "etcd://127.0.0.1:1", "/kvx-c", 2000)) != KVX_OK)
      die("set_discovery", st);
    if (kvx_agent_new_with(c, &ag) == KVX_OK || ag != NULL) die("agent with an absent etcd", KVX_OK);
    kvx_last_error(m, sizeof m);
    if (strstr(m, "127.0.0.1:1") == NULL) die("the error names the endpoint", KVX_OK);
    printf("kvx_agent_new_with, discovery at an absent etcd: %s\n", m);
    if ((st = kvx_agent_config_set_discovery(c, NULL, NULL, 0)) != KVX_OK) die("unset", st);
    if ((st = kvx_agent_new_with(c, &ag)) != KVX_OK) die("agent without discovery", st);
    kvx_agent_free(ag);
    kvx_agent_config_free(c);
  }
  printf("kvx_test %s: ok\n", transport);
  return 0;
}
