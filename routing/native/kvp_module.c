/* kvpilot's picker as an Envoy 1.40 HTTP filter dynamic module (ABI v0.2.0). The Envoy
 * declarations below are written from the ABI's documented functions (Envoy's
 * source/extensions/dynamic_modules/abi.h at v1.40); Envoy resolves them in its own binary.
 *
 * Per request: hold the headers, buffer the body, read a top-level "prompt" of token ids and
 * the session the headers name (routing/decide/sessions.py's SESSION_HEADERS), match the
 * prompt against the index the feeder keeps (kvp_feed.c), price every worker with kvpilot's
 * cost (kvp_cost.c) over what this Envoy booked (the active-block ledger, kvp_ledger.c) and
 * the sessions it placed (kvp_session.c), set x-gateway-destination-endpoint to the chosen
 * worker's host:port and x-kvpilot-decided-by: module, clear the route cache, and book the
 * request until it ends (its prefill until the answer's first bytes). A request it cannot
 * decide (no body, no token-id prompt, a cache_salt or another model than the served one, a
 * session named in the body or by a bad header, a top-level field outside the config's field
 * lines, a body over max_body_bytes) continues untouched and is counted
 * (kvpilot_picker_passthrough).
 *
 * The answer to a request it routed reaches the client without what no client reads
 * (kvp_answer.h): a stream chunk by chunk, a whole JSON answer buffered and its
 * content-length set to match (502 with KVP_WITHHELD_ANSWER when it names a withheld key and
 * cannot be read). Envoy's Lua answers filter (deploy/envoy_lua.py) does the same for every
 * other request and is off on the module's route (deploy/envoy_spec.py). */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>

#include "kvp_answer.h"
#include "kvp_module.h"

#define EXPORT __attribute__((visibility("default")))
#define ABI_VERSION "v0.2.0"
#define DESTINATION_HEADER "x-gateway-destination-endpoint"
#define DECIDED_HEADER "x-kvpilot-decided-by"
#define DYNAMO_INSTANCE_HEADER "x-dynamo-worker-instance-id"
#define DECISION_HISTOGRAM "kvpilot_picker_decision_us"

/* ---- Envoy's side of the ABI (callbacks), as documented ---- */
typedef struct { const char *ptr; size_t length; } envoy_buffer;
enum { BODY_RECEIVED_REQUEST = 0, BODY_BUFFERED_REQUEST = 1, BODY_RECEIVED_RESPONSE = 2, BODY_BUFFERED_RESPONSE = 3 };
enum { HEADER_REQUEST = 0, HEADER_RESPONSE = 2 };
enum { LOG_INFO = 2, LOG_ERROR = 4 };
#define WEAK __attribute__((weak))
WEAK extern size_t envoy_dynamic_module_callback_http_get_body_chunks_size(void *filter, int body_type);
WEAK extern bool envoy_dynamic_module_callback_http_get_body_chunks(void *filter, int body_type, envoy_buffer *out);
WEAK extern bool envoy_dynamic_module_callback_http_received_buffered_request_body(void *filter);
WEAK extern bool envoy_dynamic_module_callback_http_append_body(void *filter, int body_type, envoy_buffer data);
WEAK extern bool envoy_dynamic_module_callback_http_drain_body(void *filter, int body_type, size_t n);
WEAK extern bool envoy_dynamic_module_callback_http_set_header(void *filter, int header_type, envoy_buffer key,
                                                          envoy_buffer value);
WEAK extern bool envoy_dynamic_module_callback_http_get_header(void *filter, int header_type, envoy_buffer key,
                                                          envoy_buffer *value, size_t index, size_t *count);
WEAK extern void envoy_dynamic_module_callback_http_clear_route_cache(void *filter);
WEAK extern bool envoy_dynamic_module_callback_is_validation_mode(void);
WEAK extern void envoy_dynamic_module_callback_log(int level, envoy_buffer message);
WEAK extern int envoy_dynamic_module_callback_http_filter_config_define_counter(void *config, envoy_buffer name,
                                                                           envoy_buffer *labels, size_t n_labels,
                                                                           size_t *id);
WEAK extern int envoy_dynamic_module_callback_http_filter_increment_counter(void *filter, size_t id, envoy_buffer *labels,
                                                                       size_t n_labels, uint64_t value);
WEAK extern int envoy_dynamic_module_callback_http_filter_config_define_histogram(void *config, envoy_buffer name,
                                                                             envoy_buffer *labels, size_t n_labels,
                                                                             size_t *id);
WEAK extern int envoy_dynamic_module_callback_http_filter_record_histogram_value(void *filter, size_t id,
                                                                            envoy_buffer *labels, size_t n_labels,
                                                                            uint64_t value);

#define CALLBACK(name) {#name, (void *)(uintptr_t)name}
static const struct { const char *name; void *address; } CALLBACKS[] = {
    CALLBACK(envoy_dynamic_module_callback_http_get_body_chunks_size),
    CALLBACK(envoy_dynamic_module_callback_http_get_body_chunks),
    CALLBACK(envoy_dynamic_module_callback_http_received_buffered_request_body),
    CALLBACK(envoy_dynamic_module_callback_http_append_body),
    CALLBACK(envoy_dynamic_module_callback_http_drain_body),
    CALLBACK(envoy_dynamic_module_callback_http_set_header),
    CALLBACK(envoy_dynamic_module_callback_http_get_header),
    CALLBACK(envoy_dynamic_module_callback_http_clear_route_cache),
    CALLBACK(envoy_dynamic_module_callback_is_validation_mode),
    CALLBACK(envoy_dynamic_module_callback_log),
    CALLBACK(envoy_dynamic_module_callback_http_filter_config_define_counter),
    CALLBACK(envoy_dynamic_module_callback_http_filter_increment_counter),
    CALLBACK(envoy_dynamic_module_callback_http_filter_config_define_histogram),
    CALLBACK(envoy_dynamic_module_callback_http_filter_record_histogram_value),
};

static envoy_buffer text(const char *s) { return (envoy_buffer){s, strlen(s)}; }

static void log_line(int level, const char *message) { envoy_dynamic_module_callback_log(level, text(message)); }

/* ---- program and config ---- */
EXPORT const char *envoy_dynamic_module_on_program_init(void) {
  for (size_t i = 0; i < sizeof CALLBACKS / sizeof *CALLBACKS; i++)
    if (!CALLBACKS[i].address) { /* weak: null where this Envoy does not define it */
      fprintf(stderr, "kvpilot picker: this Envoy lacks %s; the module is built for Envoy 1.40 (ABI %s)\n",
              CALLBACKS[i].name, ABI_VERSION);
      return NULL;
    }
  return ABI_VERSION;
}

typedef struct picker_config {
  kvp_picker pk;
  int counters;
} picker_config;

static void free_state(kvp_picker *pk) {
  kvp_index_free(pk->index);
  kvp_ledger_free(pk->ledger);
  kvp_sessions_free(pk->sessions);
}

EXPORT void *envoy_dynamic_module_on_http_filter_config_new(void *config_envoy, envoy_buffer name,
                                                            envoy_buffer config) {
  (void)name;
  picker_config *pc = calloc(1, sizeof *pc);
  char err[512] = "";
  if (!pc) return NULL;
  kvp_picker *pk = &pc->pk;
  if (kvp_config_parse(pk, config.ptr ? config.ptr : "", config.length, err, sizeof err)) {
    log_line(LOG_ERROR, err);
    free(pc);
    return NULL;
  }
  uint64_t lanes[KVP_MAX_BLOCK_SIZE], position_lane;
  if (getrandom(lanes, pk->block_size * 8, 0) != (ssize_t)(pk->block_size * 8) ||
      getrandom(&position_lane, 8, 0) != 8) {
    free(pc);
    return NULL;
  }
  for (uint32_t i = 0; i < pk->block_size; i++) lanes[i] |= 1; /* odd, as chain.py's */
  pk->index = kvp_index_new(pk->block_size, pk->n_workers, pk->n_media, lanes, position_lane | 1);
  pk->ledger = kvp_ledger_new(pk->n_workers);
  pk->sessions = kvp_sessions_new(pk->max_sessions, pk->n_workers, pk->session_resident_s);
  if (!pk->index || !pk->ledger || !pk->sessions || getrandom(&pk->session_seed, 8, 0) != 8 ||
      pthread_rwlock_init(&pk->lock, NULL)) {
    log_line(LOG_ERROR, "kvpilot picker: cannot allocate the index, the ledger or the sessions");
    free_state(pk);
    free(pc);
    return NULL;
  }
  pthread_mutex_init(&pk->book_lock, NULL);
  pc->counters = !envoy_dynamic_module_callback_http_filter_config_define_counter(
                     config_envoy, text("kvpilot_picker_decided"), NULL, 0, &pk->counter_decided) &&
                 !envoy_dynamic_module_callback_http_filter_config_define_counter(
                     config_envoy, text("kvpilot_picker_passthrough"), NULL, 0, &pk->counter_passthrough) &&
                 !envoy_dynamic_module_callback_http_filter_config_define_histogram(
                     config_envoy, text(DECISION_HISTOGRAM), NULL, 0, &pk->histogram_decision);
  if (!envoy_dynamic_module_callback_is_validation_mode() && kvp_feed_start(pk, err, sizeof err)) {
    log_line(LOG_ERROR, err);
    pthread_rwlock_destroy(&pk->lock);
    pthread_mutex_destroy(&pk->book_lock);
    free_state(pk);
    free(pc);
    return NULL;
  }
  return pc;
}

EXPORT void envoy_dynamic_module_on_http_filter_config_destroy(void *config) {
  picker_config *pc = config;
  kvp_feed_stop(&pc->pk);
  char line[256];
  snprintf(line, sizeof line, "kvpilot picker: %lu event batches (%lu bad frames, %lu restarts), %lu events applied, %lu skipped",
           atomic_load(&pc->pk.batches), atomic_load(&pc->pk.bad_frames), atomic_load(&pc->pk.restarts),
           atomic_load(&pc->pk.events_applied), atomic_load(&pc->pk.events_skipped));
  log_line(LOG_INFO, line);
  pthread_rwlock_destroy(&pc->pk.lock);
  pthread_mutex_destroy(&pc->pk.book_lock);
  free_state(&pc->pk);
  free(pc);
}

/* ---- one request ---- */
typedef struct filter {
  picker_config *pc;
  int worker;           /* booked worker, -1: none */
  long prefill_booked;  /* until the answer's first bytes */
  uint64_t *keys;       /* the prompt's block keys, booked in the ledger */
  size_t n_keys;
  int has_session, ok;  /* ok: the answer's status is 2xx */
  uint64_t session;
  int decided;
  enum { ANSWER_PASSED = 0, ANSWER_STREAM, ANSWER_WHOLE } answer; /* how its answer is scrubbed */
  int routed;        /* the module set its destination */
  kvp_stream stream; /* ANSWER_STREAM: the partial line carried between chunks */
} filter;

EXPORT void *envoy_dynamic_module_on_http_filter_new(void *config, void *filter_envoy) {
  (void)filter_envoy;
  filter *f = calloc(1, sizeof *f);
  if (!f) return NULL;
  f->pc = config;
  f->worker = -1;
  return f;
}

static void count(filter *f, void *fe, int decided) {
  picker_config *pc = f->pc;
  if (pc->counters)
    envoy_dynamic_module_callback_http_filter_increment_counter(
        fe, decided ? pc->pk.counter_decided : pc->pk.counter_passthrough, NULL, 0, 1);
}

/* The bodies of ``types`` in turn, copied out of Envoy's slices; NULL when over the limit. */
static char *gather(void *fe, const int *types, int n_types, size_t limit, size_t *len) {
  size_t total = 0, cap = 0;
  char *out = NULL;
  for (int t = 0; t < n_types; t++) {
    size_t n = envoy_dynamic_module_callback_http_get_body_chunks_size(fe, types[t]);
    if (!n || n > (1u << 20)) continue;
    envoy_buffer *chunks = calloc(n, sizeof *chunks);
    if (!chunks || !envoy_dynamic_module_callback_http_get_body_chunks(fe, types[t], chunks)) {
      free(chunks);
      continue;
    }
    for (size_t i = 0; i < n; i++) {
      if (chunks[i].length > limit - total) {
        free(chunks);
        free(out);
        return NULL;
      }
      if (total + chunks[i].length > cap) {
        cap = (total + chunks[i].length) * 2 < limit ? (total + chunks[i].length) * 2 : limit;
        char *grown = realloc(out, cap ? cap : 1);
        if (!grown) return free(chunks), free(out), NULL;
        out = grown;
      }
      if (chunks[i].length) memcpy(out + total, chunks[i].ptr, chunks[i].length);
      total += chunks[i].length;
    }
    free(chunks);
  }
  *len = total;
  return out ? out : calloc(1, 1);
}

/* The whole buffered request body; NULL when over the limit. */
static char *gather_body(void *fe, size_t limit, size_t *len) {
  static const int types[2] = {BODY_BUFFERED_REQUEST, BODY_RECEIVED_REQUEST};
  return gather(fe, types, envoy_dynamic_module_callback_http_received_buffered_request_body(fe) ? 1 : 2, limit, len);
}

static uint64_t next_random(void) {
  static __thread uint64_t state;
  if (!state && (getrandom(&state, sizeof state, 0) != sizeof state || !state)) state = 0x9E3779B97F4A7C15ULL;
  state ^= state << 13, state ^= state >> 7, state ^= state << 17;
  return state;
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* routing/decide/sessions.py's SESSION_HEADERS, by precedence (Envoy keeps names in lower case). */
static const char *const SESSION_HEADERS[] = {
    "x-session-id", "x-dynamo-session-id", "x-claude-code-session-id", "session_id", "x-session-affinity",
    "x-opencode-session",
};
#define MAX_SESSION_KEY 256 /* sessions.py's MAX_KEY_LENGTH */

enum session_header { SESSION_NONE = 0, SESSION_NAMED = 1, SESSION_BAD = 2 };

/* The session the first present of SESSION_HEADERS names, keyed by ``seed`` (FNV-1a over the
 * seed and the name): SESSION_BAD when that header is empty or too long (the Python picker
 * answers it). */
static int session_of(void *fe, uint64_t seed, uint64_t *key) {
  for (size_t h = 0; h < sizeof SESSION_HEADERS / sizeof *SESSION_HEADERS; h++) {
    envoy_buffer value = {NULL, 0};
    size_t n = 0;
    if (!envoy_dynamic_module_callback_http_get_header(fe, HEADER_REQUEST, text(SESSION_HEADERS[h]), &value, 0, &n) ||
        !value.ptr)
      continue;
    if (!value.length || value.length > MAX_SESSION_KEY) return SESSION_BAD;
    uint64_t x = 0xCBF29CE484222325ULL ^ seed;
    for (size_t i = 0; i < value.length; i++) x = (x ^ (unsigned char)value.ptr[i]) * 0x100000001B3ULL;
    *key = x ^ (x >> 31);
    return SESSION_NAMED;
  }
  return SESSION_NONE;
}

/* Choose a worker for the prompt ``ids`` (its block ``keys``) and book it, as Router.route
 * prices a co-located fleet at router_temperature 0: each worker's overlap, its booked
 * prefill, unique active blocks and requests, the prompt's blocks already active there; a
 * session's later step with its last worker's affinity, any other request with the blocks
 * of the sessions living on each worker. Returns the worker, or -1. */
static int choose_and_book(kvp_picker *pk, filter *f, const uint32_t *ids, size_t n_ids) {
  uint32_t n = pk->n_workers, m = pk->n_media, shared = 0;
  uint32_t *depths = calloc((size_t)n * m, sizeof *depths);
  double *overlap = calloc((size_t)n * 4, sizeof *overlap), *costs = calloc(n, sizeof *costs);
  kvp_load *loads = calloc(n, sizeof *loads);
  uint32_t *ties = calloc(n, sizeof *ties);
  int chosen = -1;
  if (depths && overlap && costs && loads && ties) {
    pthread_rwlock_rdlock(&pk->lock);
    size_t blocks = kvp_index_match(pk->index, ids, n_ids, depths);
    pthread_rwlock_unlock(&pk->lock);
    for (uint32_t i = 0; i < n * m; i++)
      if (pk->classes[i % m] == KVP_SHARED && depths[i] > shared) shared = depths[i];
    for (uint32_t w = 0; w < n; w++) kvp_tier_overlap(depths + (size_t)w * m, pk->classes, m, shared, overlap + 4 * w);
    pthread_mutex_lock(&pk->book_lock);
    double now = now_s(); /* under the lock: the sessions' times never decrease */
    int last = f->has_session ? kvp_sessions_last(pk->sessions, f->session) : -1;
    const double *resident = last < 0 ? kvp_sessions_resident(pk->sessions, now) : NULL;
    for (uint32_t w = 0; w < n; w++) {
      loads[w].prefill_blocks = (double)pk->workers[w].prefill_blocks;
      loads[w].decode_blocks = (double)kvp_ledger_unique(pk->ledger, w);
      loads[w].requests = (double)pk->workers[w].requests;
      loads[w].shared_decode_blocks = (double)kvp_ledger_shared_depth(pk->ledger, w, f->keys, f->n_keys);
      loads[w].resident_blocks = resident ? resident[w] : 0.0;
      loads[w].session_affinity = (int)w == last;
    }
    size_t n_ties = kvp_price(&pk->cost, blocks, n, overlap, loads, costs, ties);
    if (n_ties) {
      chosen = (int)ties[next_random() % n_ties];
      if (kvp_ledger_add(pk->ledger, (uint32_t)chosen, f->keys, f->n_keys) != KVP_APPLIED) {
        chosen = -1;
      } else {
        long gpu = (long)overlap[4 * chosen];
        f->prefill_booked = (long)blocks - gpu > 0 ? (long)blocks - gpu : 0;
        pk->workers[chosen].prefill_blocks += f->prefill_booked;
        pk->workers[chosen].requests++;
        if (f->has_session) kvp_sessions_settle(pk->sessions, f->session, (uint32_t)chosen, (uint32_t)blocks, now);
        f->worker = chosen;
      }
    }
    pthread_mutex_unlock(&pk->book_lock);
  }
  free(depths), free(overlap), free(costs), free(loads), free(ties);
  return chosen;
}

static void decide(filter *f, void *fe) {
  kvp_picker *pk = &f->pc->pk;
  size_t len = 0, n_ids = 0;
  double started = now_s();
  f->decided = 1;
  int session = session_of(fe, pk->session_seed, &f->session);
  if (session == SESSION_BAD) return count(f, fe, 0);
  f->has_session = session == SESSION_NAMED;
  char *body = gather_body(fe, pk->max_body_bytes, &len);
  size_t max_ids = len / 2 + 1 < pk->max_prompt_ids ? len / 2 + 1 : pk->max_prompt_ids;
  uint32_t *ids = body ? malloc(max_ids * sizeof *ids) : NULL;
  int worker = -1;
  const char *model = pk->model[0] ? pk->model : NULL;
  if (ids && kvp_parse_prompt(body, len, model, pk->fields, ids, max_ids, &n_ids) == KVP_BODY_OK && n_ids) {
    f->n_keys = n_ids / pk->block_size;
    f->keys = malloc((f->n_keys ? f->n_keys : 1) * sizeof *f->keys);
    if (f->keys) {
      kvp_chain_keys(pk->index, ids, f->n_keys, 0, 0, f->keys);
      worker = choose_and_book(pk, f, ids, n_ids);
    }
  }
  free(body);
  free(ids);
  if (worker < 0) return count(f, fe, 0);
  kvp_worker *w = &pk->workers[worker];
  if (pk->dynamo_frontend[0]) { /* Dynamo's frontend in direct mode serves the instance the header names */
    envoy_dynamic_module_callback_http_set_header(fe, HEADER_REQUEST, text(DESTINATION_HEADER),
                                                  text(pk->dynamo_frontend));
    envoy_dynamic_module_callback_http_set_header(fe, HEADER_REQUEST, text(DYNAMO_INSTANCE_HEADER),
                                                  text(w->destination));
  } else {
    envoy_dynamic_module_callback_http_set_header(fe, HEADER_REQUEST, text(DESTINATION_HEADER), text(w->destination));
  }
  envoy_dynamic_module_callback_http_set_header(fe, HEADER_REQUEST, text(DECIDED_HEADER), text("module"));
  envoy_dynamic_module_callback_http_clear_route_cache(fe);
  f->routed = 1;
  count(f, fe, 1);
  if (f->pc->counters) /* the decision, body gathered and parsed to destination set, in microseconds */
    envoy_dynamic_module_callback_http_filter_record_histogram_value(
        fe, pk->histogram_decision, NULL, 0, (uint64_t)((now_s() - started) * 1e6 + 0.5));
}

/* The prefill is over: the answer's first bytes (a stream's first token) reached Envoy. */
static void release_prefill(filter *f) {
  if (f->worker >= 0 && f->prefill_booked) {
    kvp_picker *pk = &f->pc->pk;
    pthread_mutex_lock(&pk->book_lock);
    pk->workers[f->worker].prefill_blocks -= f->prefill_booked;
    pthread_mutex_unlock(&pk->book_lock);
    f->prefill_booked = 0;
  }
}

/* The request ended: release all it booked; a session answered 2xx was served there. */
static void release(filter *f) {
  if (f->worker >= 0) {
    kvp_picker *pk = &f->pc->pk;
    pthread_mutex_lock(&pk->book_lock);
    kvp_worker *w = &pk->workers[f->worker];
    w->prefill_blocks -= f->prefill_booked;
    w->requests--;
    kvp_ledger_remove(pk->ledger, (uint32_t)f->worker, f->keys, f->n_keys);
    if (f->has_session && f->ok)
      kvp_sessions_served(pk->sessions, f->session, (uint32_t)f->worker, (uint32_t)f->n_keys, now_s());
    pthread_mutex_unlock(&pk->book_lock);
    f->worker = -1, f->prefill_booked = 0;
  }
  free(f->keys);
  f->keys = NULL, f->n_keys = 0;
}

EXPORT void envoy_dynamic_module_on_http_filter_destroy(void *fm) {
  release(fm);
  kvp_stream_clear(&((filter *)fm)->stream);
  free(fm);
}

EXPORT int envoy_dynamic_module_on_http_filter_request_headers(void *fe, void *fm, bool end_of_stream) {
  if (end_of_stream) { /* no body to read */
    count(fm, fe, 0);
    return 0; /* Continue */
  }
  return 1; /* StopIteration: held until the body is read */
}

EXPORT int envoy_dynamic_module_on_http_filter_request_body(void *fe, void *fm, bool end_of_stream) {
  if (!end_of_stream) return 1; /* StopIterationAndBuffer */
  if (!((filter *)fm)->decided) decide(fm, fe);
  return 0;
}

EXPORT int envoy_dynamic_module_on_http_filter_request_trailers(void *fe, void *fm) {
  if (!((filter *)fm)->decided) decide(fm, fe);
  return 0;
}

/* 1 when the header's value starts with ``kind`` in any case. */
static int typed(envoy_buffer value, const char *kind) {
  size_t n = strlen(kind);
  return value.ptr && value.length >= n && !strncasecmp(value.ptr, kind, n);
}

EXPORT int envoy_dynamic_module_on_http_filter_response_headers(void *fe, void *fm, bool end_of_stream) {
  filter *f = fm;
  envoy_buffer status = {NULL, 0}, kind = {NULL, 0};
  size_t n = 0;
  if (f->worker >= 0 && envoy_dynamic_module_callback_http_get_header(fe, HEADER_RESPONSE, text(":status"), &status, 0, &n))
    f->ok = status.ptr && status.length == 3 && status.ptr[0] == '2';
  if (end_of_stream) {
    release_prefill(f);
    return 0;
  }
  if (f->routed && envoy_dynamic_module_callback_http_get_header(fe, HEADER_RESPONSE, text("content-type"), &kind, 0, &n)) {
    if (typed(kind, "text/event-stream")) f->answer = ANSWER_STREAM;
    if (typed(kind, "application/json")) f->answer = ANSWER_WHOLE;
  }
  return f->answer == ANSWER_WHOLE; /* StopIteration: the headers wait for the body they describe */
}

/* The length of Envoy's body of ``type`` (0: none). */
static size_t body_size(void *fe, int type) {
  size_t n = envoy_dynamic_module_callback_http_get_body_chunks_size(fe, type), total = 0;
  envoy_buffer *chunks = n ? calloc(n, sizeof *chunks) : NULL;
  if (chunks && envoy_dynamic_module_callback_http_get_body_chunks(fe, type, chunks))
    for (size_t i = 0; i < n; i++) total += chunks[i].length;
  free(chunks);
  return total;
}

/* A whole answer, all of it in Envoy's buffer now (and in the last chunk received, with
 * ``with_received``), as the client gets it: scrubbed, its content-length set to match. */
static void scrub_whole(void *fe, int with_received) {
  static const int types[2] = {BODY_BUFFERED_RESPONSE, BODY_RECEIVED_RESPONSE};
  int n_types = 1 + with_received;
  size_t len = 0, out_len = 0;
  char *body = gather(fe, types, n_types, SIZE_MAX, &len), *out = NULL;
  int rc = body ? kvp_scrub_answer(body, len, &out, &out_len) : KVP_SCRUB_NO_MEMORY;
  free(body);
  if (rc == KVP_SCRUB_UNCHANGED) return;
  if (rc != KVP_SCRUB_CHANGED) { /* it names a withheld key and cannot be read: withheld, not passed on */
    envoy_dynamic_module_callback_http_set_header(fe, HEADER_RESPONSE, text(":status"), text("502"));
    free(out);
    out = NULL, out_len = strlen(kvp_withheld_answer);
  }
  for (int t = 0; t < n_types; t++) {
    size_t had = body_size(fe, types[t]);
    if (had) envoy_dynamic_module_callback_http_drain_body(fe, types[t], had);
  }
  envoy_dynamic_module_callback_http_append_body(fe, types[n_types - 1], (envoy_buffer){out ? out : kvp_withheld_answer, out_len});
  char length[24];
  snprintf(length, sizeof length, "%zu", out_len);
  envoy_dynamic_module_callback_http_set_header(fe, HEADER_RESPONSE, text("content-length"), text(length));
  free(out);
}

/* One chunk of a stream as the client gets it. */
static void scrub_chunk(filter *f, void *fe) {
  static const int received = BODY_RECEIVED_RESPONSE;
  size_t len = 0, out_len = 0;
  envoy_buffer one = {NULL, 0};
  char *copied = NULL, *out = NULL;
  if (envoy_dynamic_module_callback_http_get_body_chunks_size(fe, received) == 1 &&
      envoy_dynamic_module_callback_http_get_body_chunks(fe, received, &one)) /* read in place */
    len = one.length;
  else
    one.ptr = copied = gather(fe, &received, 1, SIZE_MAX, &len);
  int rc = one.ptr || !len ? kvp_stream_feed(&f->stream, one.ptr ? one.ptr : "", len, &out, &out_len)
                           : KVP_SCRUB_NO_MEMORY;
  free(copied);
  if (rc == KVP_SCRUB_UNCHANGED) return;
  if (len) envoy_dynamic_module_callback_http_drain_body(fe, received, len);
  if (rc == KVP_SCRUB_CHANGED) {
    if (out_len) envoy_dynamic_module_callback_http_append_body(fe, received, (envoy_buffer){out, out_len});
  } else { /* no memory to scrub it: the chunk is withheld, an error event takes its place */
    envoy_dynamic_module_callback_http_append_body(fe, received, text("data: "));
    envoy_dynamic_module_callback_http_append_body(fe, received, text(kvp_withheld_chunk));
    envoy_dynamic_module_callback_http_append_body(fe, received, text("\n\n"));
  }
  free(out);
}

EXPORT int envoy_dynamic_module_on_http_filter_response_body(void *fe, void *fm, bool end_of_stream) {
  filter *f = fm;
  release_prefill(f); /* the answer's first bytes: the prefill is over */
  if (f->answer == ANSWER_STREAM) scrub_chunk(f, fe);
  if (f->answer != ANSWER_WHOLE) return 0;
  if (!end_of_stream) return 1; /* StopIterationAndBuffer */
  scrub_whole(fe, 1);
  return 0;
}

EXPORT void envoy_dynamic_module_on_http_filter_stream_complete(void *fe, void *fm) {
  (void)fe;
  release(fm);
}

/* Hooks Envoy requires of every HTTP filter module; this one has no use for them. */
EXPORT int envoy_dynamic_module_on_http_filter_response_trailers(void *fe, void *fm) {
  if (((filter *)fm)->answer == ANSWER_WHOLE) scrub_whole(fe, 0); /* the body ended before its trailers */
  return 0;
}
EXPORT int envoy_dynamic_module_on_http_filter_local_reply(void *fe, void *fm) { (void)fe, (void)fm; return 0; }
EXPORT void *envoy_dynamic_module_on_http_filter_per_route_config_new(void) { return NULL; }
EXPORT void envoy_dynamic_module_on_http_filter_per_route_config_destroy(void *c) { (void)c; }
EXPORT void envoy_dynamic_module_on_http_filter_http_callout_done(void) {}
EXPORT void envoy_dynamic_module_on_http_filter_http_stream_headers(void) {}
EXPORT void envoy_dynamic_module_on_http_filter_http_stream_data(void) {}
EXPORT void envoy_dynamic_module_on_http_filter_http_stream_trailers(void) {}
EXPORT void envoy_dynamic_module_on_http_filter_http_stream_complete(void) {}
EXPORT void envoy_dynamic_module_on_http_filter_http_stream_reset(void) {}
EXPORT void envoy_dynamic_module_on_http_filter_scheduled(void) {}
EXPORT void envoy_dynamic_module_on_http_filter_downstream_above_write_buffer_high_watermark(void) {}
EXPORT void envoy_dynamic_module_on_http_filter_downstream_below_write_buffer_low_watermark(void) {}
EXPORT void envoy_dynamic_module_on_http_filter_config_scheduled(void) {}
EXPORT void envoy_dynamic_module_on_http_filter_config_http_callout_done(void) {}
EXPORT void envoy_dynamic_module_on_http_filter_config_http_stream_headers(void) {}
EXPORT void envoy_dynamic_module_on_http_filter_config_http_stream_data(void) {}
EXPORT void envoy_dynamic_module_on_http_filter_config_http_stream_trailers(void) {}
EXPORT void envoy_dynamic_module_on_http_filter_config_http_stream_complete(void) {}
EXPORT void envoy_dynamic_module_on_http_filter_config_http_stream_reset(void) {}
