/* The picker's configuration and its feeder: a thread that subscribes to each configured
 * engine's KV-event socket (libzmq, loaded from the configured path: nothing is linked at
 * build time) and applies each batch to the index under the write lock. Only the configured
 * endpoints are bound or connected; a frame that is not (topic, 8-byte seq, payload), a
 * payload over the size limit or an undecodable batch is counted and dropped. */
#include <dlfcn.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <time.h>
#include <unistd.h>

#include "kvp_module.h"

#define ZMQ_SUB 2
#define ZMQ_SUBSCRIBE 6
#define ZMQ_LINGER 17
#define ZMQ_MAXMSGSIZE 22
#define ZMQ_FD 14
#define ZMQ_EVENTS 15
#define ZMQ_DONTWAIT 1
#define ZMQ_POLLIN 1
#define WAIT_MS 100    /* the longest one wait for a socket lasts (so a stop is seen) */
#define SWEEP_MS 1000 /* every socket is drained at least this often, woken or not */

typedef struct { unsigned char bytes[64]; } __attribute__((aligned(8))) zmq_msg;

typedef struct zmq_api {
  void *(*ctx_new)(void);
  int (*ctx_term)(void *);
  void *(*socket)(void *, int);
  int (*close)(void *);
  int (*setsockopt)(void *, int, const void *, size_t);
  int (*getsockopt)(void *, int, void *, size_t *);
  int (*connect)(void *, const char *);
  int (*bind)(void *, const char *);
  int (*msg_init)(zmq_msg *);
  int (*msg_recv)(zmq_msg *, void *, int);
  int (*msg_close)(zmq_msg *);
  void *(*msg_data)(zmq_msg *);
  size_t (*msg_size)(const zmq_msg *);
  int (*msg_more)(const zmq_msg *);
} zmq_api;

/* ---- configuration ---- */
static int class_of(const char *name) {
  static const char *const names[] = {"gpu", "host", "disk", "shared"};
  for (int k = 0; k < 4; k++)
    if (!strcmp(name, names[k])) return k;
  return -1;
}

static double *cost_field(kvp_cost_config *c, const char *name) {
#define F(x) if (!strcmp(name, #x)) return &c->x;
  F(overlap_score_credit) F(overlap_score_credit_decay) F(host_cache_hit_weight)
  F(disk_cache_hit_weight) F(shared_cache_multiplier) F(prefill_load_scale)
  F(decode_active_request_weight) F(session_affinity_credit) F(session_residency_weight)
#undef F
  return NULL;
}

int kvp_config_parse(kvp_picker *pk, const char *text, size_t len, char *err, size_t err_len) {
  kvp_cost_config c = {1.0, 0.0, 0.75, 0.25, 0.5, 1.0, 0.0, 16.0, 1.0, 1};
  pk->cost = c;
  pk->block_size = 0;
  snprintf(pk->topic, sizeof pk->topic, "%s", "");
  pk->fields[0] = 0;
  pk->max_body_bytes = 8u << 20, pk->max_prompt_ids = 1u << 20, pk->max_event_tokens = 1u << 20;
  pk->max_sessions = 10000, pk->session_resident_s = 30.0; /* routing/config/sessions.py's defaults */
  char *copy = strndup(text, len), *save = NULL;
  if (!copy) return snprintf(err, err_len, "out of memory"), -1;
  int rc = 0, line_no = 0;
  for (char *line = strtok_r(copy, "\n;", &save); line && !rc; line = strtok_r(NULL, "\n;", &save)) {
    char key[64], a[KVP_NAME_MAX], b[KVP_NAME_MAX], m[16], extra[2];
    line_no++;
    int n = sscanf(line, " %63s %255s %15s %255s %1s", key, a, m, b, extra);
    if (n <= 0 || key[0] == '#') continue;
    double *f = n == 2 && !strncmp(key, "cost.", 5) ? cost_field(&pk->cost, key + 5) : NULL;
    char *end = NULL;
    unsigned long long v = n == 2 ? strtoull(a, &end, 10) : 0;
    int number = n == 2 && end && !*end && a[0] != '-';
    if (f) {
      *f = strtod(a, &end);
      if (*end) rc = -1;
    } else if (!strcmp(key, "block_size") && number && v && v <= KVP_MAX_BLOCK_SIZE) {
      pk->block_size = (uint32_t)v;
    } else if (!strcmp(key, "max_body_bytes") && number && v >= 64 && v <= (1ULL << 30)) {
      pk->max_body_bytes = v;
    } else if (!strcmp(key, "max_prompt_ids") && number && v && v <= (1ULL << 24)) {
      pk->max_prompt_ids = v;
    } else if (!strcmp(key, "max_sessions") && number && v && v <= (1ULL << 24)) {
      pk->max_sessions = (uint32_t)v;
    } else if (!strcmp(key, "session_resident_s") && n == 2) {
      pk->session_resident_s = strtod(a, &end);
      if (*end || !(pk->session_resident_s > 0) || pk->session_resident_s > 1e9) rc = -1;
    } else if (!strcmp(key, "cost.session_stays_unless_sooner") && number && v <= 1) {
      pk->cost.session_stays_unless_sooner = (int)v;
    } else if (!strcmp(key, "topic") && n == 2 && strlen(a) < sizeof pk->topic) {
      snprintf(pk->topic, sizeof pk->topic, "%s", a);
    } else if (!strcmp(key, "dynamo_frontend") && n == 2 && strlen(a) < sizeof pk->dynamo_frontend) {
      snprintf(pk->dynamo_frontend, sizeof pk->dynamo_frontend, "%s", a);
    } else if (!strcmp(key, "model") && n == 2 && strlen(a) < sizeof pk->model) {
      snprintf(pk->model, sizeof pk->model, "%s", a);
    } else if (!strcmp(key, "field") && n == 2 && strlen(pk->fields) + strlen(a) + 2 <= sizeof pk->fields) {
      strcat(strcat(pk->fields, pk->fields[0] ? "\n" : ""), a);
    } else if (!strcmp(key, "libzmq") && n == 2 && strlen(a) < sizeof pk->libzmq) {
      snprintf(pk->libzmq, sizeof pk->libzmq, "%s", a);
    } else if (!strcmp(key, "medium") && n == 3 && class_of(m) >= 0 && pk->n_media < KVP_MAX_MEDIA &&
               strlen(a) < sizeof pk->media[0]) {
      snprintf(pk->media[pk->n_media], sizeof pk->media[0], "%s", a);
      pk->classes[pk->n_media++] = (uint8_t)class_of(m);
    } else if (!strcmp(key, "worker") && n == 4 && pk->n_workers < KVP_MAX_WORKERS &&
               (!strcmp(m, "connect") || !strcmp(m, "bind"))) {
      kvp_worker *w = &pk->workers[pk->n_workers++];
      snprintf(w->destination, sizeof w->destination, "%s", a);
      snprintf(w->endpoint, sizeof w->endpoint, "%s", b);
      w->bind = !strcmp(m, "bind");
    } else if (!strcmp(key, "worker") && n == 2 && pk->n_workers < KVP_MAX_WORKERS) {
      snprintf(pk->workers[pk->n_workers++].destination, KVP_NAME_MAX, "%s", a); /* no events */
    } else {
      rc = -1;
    }
    if (rc) snprintf(err, err_len, "kvpilot picker config line %d: cannot read '%s'", line_no, line);
  }
  free(copy);
  if (rc) return -1;
  if (!pk->block_size || !pk->n_workers || !pk->fields[0]) {
    snprintf(err, err_len,
             "kvpilot picker config: block_size, at least one worker and at least one field (the top-level fields a "
             "client may send: routing/serve/request_fields.py) are required");
    return -1;
  }
  if (!pk->n_media) { /* routing/config.py's default index.tiers */
    static const char *const media[] = {"GPU", "CPU", "CPU_PINNED", "STORAGE"};
    static const uint8_t classes[] = {KVP_GPU, KVP_HOST, KVP_HOST, KVP_DISK};
    for (int i = 0; i < 4; i++) snprintf(pk->media[i], sizeof pk->media[0], "%s", media[i]), pk->classes[i] = classes[i];
    pk->n_media = 4;
  }
  if (pk->n_workers * pk->n_media > KVP_MAX_SLOTS) {
    snprintf(err, err_len, "kvpilot picker config: %u workers x %u media exceed %d slots", pk->n_workers,
             pk->n_media, KVP_MAX_SLOTS);
    return -1;
  }
  for (uint32_t i = 0; i < pk->n_workers; i++)
    if (pk->workers[i].endpoint[0] && !pk->libzmq[0]) {
      snprintf(err, err_len, "kvpilot picker config: a worker names a KV-event endpoint and no libzmq path is set");
      return -1;
    }
  return 0;
}

/* ---- the feeder ---- */
typedef struct feed_ctx {
  kvp_picker *pk;
  uint32_t worker;
} feed_ctx;

static void apply_event(void *arg, const kvp_event *ev) {
  feed_ctx *f = arg;
  kvp_picker *pk = f->pk;
  int medium = -1;
  for (uint32_t m = 0; m < pk->n_media; m++)
    if (strlen(pk->media[m]) == ev->medium_len && !memcmp(pk->media[m], ev->medium, ev->medium_len)) medium = (int)m;
  int outcome = KVP_APPLIED;
  if (ev->kind == KVP_EV_CLEARED) kvp_index_clear_worker(pk->index, f->worker);
  else if (medium < 0) outcome = KVP_SKIP_UNKNOWN_SLOT;
  else if (ev->kind == KVP_EV_STORED)
    outcome = kvp_index_store(pk->index, f->worker, (uint32_t)medium, ev->ehashes, ev->n_hashes, ev->has_parent,
                              ev->parent, ev->block_size, ev->tokens, ev->n_tokens);
  else outcome = kvp_index_remove(pk->index, f->worker, (uint32_t)medium, ev->ehashes, ev->n_hashes);
  if (outcome == KVP_APPLIED) atomic_fetch_add(&pk->events_applied, 1);
  else atomic_fetch_add(&pk->events_skipped, 1);
}

static void on_batch(kvp_picker *pk, uint32_t worker, uint64_t seq, const uint8_t *payload, size_t len,
                     kvp_scratch *scratch) {
  kvp_worker *w = &pk->workers[worker];
  feed_ctx ctx = {pk, worker};
  kvp_batch_counts counts = {0, 0, 0, 0};
  pthread_rwlock_wrlock(&pk->lock);
  if (w->seen_seq && seq <= w->last_seq) { /* the engine restarted: its cache is gone */
    kvp_index_clear_worker(pk->index, worker);
    atomic_fetch_add(&pk->restarts, 1);
  }
  w->seen_seq = 1, w->last_seq = seq;
  if (kvp_decode_batch(payload, len, scratch, apply_event, &ctx, &counts) != KVP_BATCH_OK)
    atomic_fetch_add(&pk->bad_frames, 1);
  pthread_rwlock_unlock(&pk->lock);
  atomic_fetch_add(&pk->batches, 1);
}

typedef struct feeder_args {
  kvp_picker *pk;
  zmq_api z;
  void *ctx;
  void *sockets[KVP_MAX_WORKERS];
  uint32_t owner[KVP_MAX_WORKERS];
  int n;
} feeder_args;

static void drain(feeder_args *a, int i, kvp_scratch *scratch) {
  int rechecked = 0; /* one recheck per message at most: a socket that says POLLIN and reads nothing is left */
  for (;;) {
    zmq_msg parts[3];
    int got = 0, more = 1, bad = 0;
    while (more) {
      zmq_msg part;
      a->z.msg_init(&part);
      if (a->z.msg_recv(&part, a->sockets[i], got ? 0 : ZMQ_DONTWAIT) < 0) {
        a->z.msg_close(&part);
        if (!got) { /* nothing waiting, unless the socket's state says more came (which rearms its ZMQ_FD) */
          int events = 0;
          size_t size = sizeof events;
          if (rechecked++ || a->z.getsockopt(a->sockets[i], ZMQ_EVENTS, &events, &size) || !(events & ZMQ_POLLIN))
            return;
          more = 0; /* a message came after all: read it on the next turn */
          continue;
        }
        bad = 1;
        break;
      }
      more = a->z.msg_more(&part);
      if (got < 3) parts[got] = part;
      else a->z.msg_close(&part), bad = 1;
      got++;
    }
    if (!got) continue;
    rechecked = 0;
    int kept = got < 3 ? got : 3;
    if (!bad && got == 3 && a->z.msg_size(&parts[1]) == 8) {
      const uint8_t *s = a->z.msg_data(&parts[1]);
      uint64_t seq = 0;
      for (int k = 0; k < 8; k++) seq = seq << 8 | s[k];
      on_batch(a->pk, a->owner[i], seq, a->z.msg_data(&parts[2]), a->z.msg_size(&parts[2]), scratch);
    } else {
      atomic_fetch_add(&a->pk->bad_frames, 1);
    }
    for (int k = 0; k < kept; k++) a->z.msg_close(&parts[k]);
  }
}

static long now_ms(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1000L + t.tv_nsec / 1000000L;
}

/* Waits on every socket's ZMQ_FD in one epoll and drains only the sockets it names
 * (zmq_poll checks every socket on each of its many wakeups a batch); every SWEEP_MS, drains
 * them all, so no batch waits on a missed edge longer than that. */
static void *feeder_main(void *arg) {
  feeder_args *a = arg;
  kvp_picker *pk = a->pk;
  size_t max_tokens = pk->max_event_tokens, max_hashes = max_tokens / pk->block_size + 1;
  kvp_scratch scratch = {malloc(max_hashes * 8), max_hashes, malloc(max_tokens * 4), max_tokens};
  int ep = epoll_create1(EPOLL_CLOEXEC);
  for (int i = 0; i < a->n && ep >= 0; i++) {
    int fd = -1;
    size_t size = sizeof fd;
    struct epoll_event ev = {.events = EPOLLIN, .data.u32 = (uint32_t)i};
    if (a->z.getsockopt(a->sockets[i], ZMQ_FD, &fd, &size) || epoll_ctl(ep, EPOLL_CTL_ADD, fd, &ev))
      close(ep), ep = -1; /* no epoll: every socket is drained each WAIT_MS */
  }
  long next_sweep = 0; /* without epoll, every wait ends in a sweep */
  struct epoll_event ready[KVP_MAX_WORKERS];
  while (scratch.hashes && scratch.tokens && !atomic_load(&pk->stop)) {
    int n = ep >= 0 ? epoll_wait(ep, ready, KVP_MAX_WORKERS, WAIT_MS) : 0;
    if (ep < 0) {
      struct timespec pause = {0, WAIT_MS * 1000000L};
      nanosleep(&pause, NULL);
    }
    long now = now_ms();
    if (now >= next_sweep || ep < 0) {
      next_sweep = now + SWEEP_MS;
      for (int i = 0; i < a->n; i++) drain(a, i, &scratch);
    } else {
      for (int k = 0; k < n; k++) drain(a, (int)ready[k].data.u32, &scratch);
    }
  }
  if (ep >= 0) close(ep);
  free(scratch.hashes);
  free(scratch.tokens);
  for (int i = 0; i < a->n; i++) a->z.close(a->sockets[i]);
  a->z.ctx_term(a->ctx);
  free(a);
  return NULL;
}

static int load_zmq(zmq_api *z, const char *path, char *err, size_t err_len) {
  void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!lib) return snprintf(err, err_len, "kvpilot picker: cannot load libzmq '%s': %s", path, dlerror()), -1;
#define SYM(field, name) if (!(*(void **)&z->field = dlsym(lib, name))) \
    return snprintf(err, err_len, "kvpilot picker: '%s' lacks %s", path, name), -1;
  SYM(ctx_new, "zmq_ctx_new") SYM(ctx_term, "zmq_ctx_term") SYM(socket, "zmq_socket") SYM(close, "zmq_close")
  SYM(setsockopt, "zmq_setsockopt") SYM(connect, "zmq_connect") SYM(bind, "zmq_bind")
  SYM(getsockopt, "zmq_getsockopt")
  SYM(msg_init, "zmq_msg_init") SYM(msg_recv, "zmq_msg_recv") SYM(msg_close, "zmq_msg_close")
  SYM(msg_data, "zmq_msg_data") SYM(msg_size, "zmq_msg_size") SYM(msg_more, "zmq_msg_more")
#undef SYM
  return 0;
}

int kvp_feed_start(kvp_picker *pk, char *err, size_t err_len) {
  feeder_args *a = calloc(1, sizeof *a);
  if (!a) return snprintf(err, err_len, "out of memory"), -1;
  a->pk = pk;
  for (uint32_t i = 0; i < pk->n_workers; i++)
    if (pk->workers[i].endpoint[0]) a->owner[a->n++] = i;
  if (!a->n) return free(a), 0;
  if (load_zmq(&a->z, pk->libzmq, err, err_len)) return free(a), -1;
  a->ctx = a->z.ctx_new();
  int64_t max_msg = (int64_t)pk->max_body_bytes;
  int zero = 0;
  for (int i = 0; i < a->n; i++) {
    kvp_worker *w = &pk->workers[a->owner[i]];
    void *s = a->sockets[i] = a->z.socket(a->ctx, ZMQ_SUB);
    int rc = !s || a->z.setsockopt(s, ZMQ_SUBSCRIBE, pk->topic, strlen(pk->topic)) ||
             a->z.setsockopt(s, ZMQ_LINGER, &zero, sizeof zero) ||
             a->z.setsockopt(s, ZMQ_MAXMSGSIZE, &max_msg, sizeof max_msg) ||
             (w->bind ? a->z.bind(s, w->endpoint) : a->z.connect(s, w->endpoint));
    if (rc) {
      snprintf(err, err_len, "kvpilot picker: cannot %s %s (errno %d)", w->bind ? "bind" : "connect", w->endpoint, errno);
      for (int k = 0; k <= i; k++) if (a->sockets[k]) a->z.close(a->sockets[k]);
      a->z.ctx_term(a->ctx);
      return free(a), -1;
    }
  }
  atomic_store(&pk->stop, 0);
  if (pthread_create(&pk->feeder, NULL, feeder_main, a)) {
    snprintf(err, err_len, "kvpilot picker: cannot start the feeder thread");
    for (int k = 0; k < a->n; k++) a->z.close(a->sockets[k]);
    a->z.ctx_term(a->ctx);
    return free(a), -1;
  }
  pthread_setname_np(pk->feeder, "kvpilot-feeder"); /* as the router's: per-thread CPU shows it */
  pk->feeder_started = 1;
  return 0;
}

void kvp_feed_stop(kvp_picker *pk) {
  if (!pk->feeder_started) return;
  atomic_store(&pk->stop, 1);
  pthread_join(pk->feeder, NULL);
  pk->feeder_started = 0;
}
