/* kvpilot's picker as an Envoy 1.40 HTTP filter dynamic module (ABI v0.2.0). The Envoy
 * declarations below are written from the ABI's documented functions (Envoy's
 * source/extensions/dynamic_modules/abi.h at v1.40); Envoy resolves them in its own binary.
 *
 * Per request: hold the headers, buffer the body, read a top-level "prompt" of token ids,
 * match it against the index the feeder keeps (kvp_feed.c), price every worker with kvpilot's
 * cost (kvp_cost.c), set x-gateway-destination-endpoint to the chosen worker's host:port and
 * x-kvpilot-decided-by: module, clear the route cache, and book the request's load until it
 * ends. A request it cannot decide (no body, no token-id prompt, a cache_salt, a body over
 * max_body_bytes) continues untouched and is counted (kvpilot_picker_passthrough). */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>

#include "kvp_module.h"

#define EXPORT __attribute__((visibility("default")))
#define ABI_VERSION "v0.2.0"
#define DESTINATION_HEADER "x-gateway-destination-endpoint"
#define DECIDED_HEADER "x-kvpilot-decided-by"
#define DYNAMO_INSTANCE_HEADER "x-dynamo-worker-instance-id"

/* ---- Envoy's side of the ABI (callbacks), as documented ---- */
typedef struct { const char *ptr; size_t length; } envoy_buffer;
enum { BODY_RECEIVED_REQUEST = 0, BODY_BUFFERED_REQUEST = 1 };
enum { HEADER_REQUEST = 0 };
enum { LOG_INFO = 2, LOG_ERROR = 4 };
#define WEAK __attribute__((weak))
WEAK extern size_t envoy_dynamic_module_callback_http_get_body_chunks_size(void *filter, int body_type);
WEAK extern bool envoy_dynamic_module_callback_http_get_body_chunks(void *filter, int body_type, envoy_buffer *out);
WEAK extern bool envoy_dynamic_module_callback_http_received_buffered_request_body(void *filter);
WEAK extern bool envoy_dynamic_module_callback_http_set_header(void *filter, int header_type, envoy_buffer key,
                                                          envoy_buffer value);
WEAK extern void envoy_dynamic_module_callback_http_clear_route_cache(void *filter);
WEAK extern bool envoy_dynamic_module_callback_is_validation_mode(void);
WEAK extern void envoy_dynamic_module_callback_log(int level, envoy_buffer message);
WEAK extern int envoy_dynamic_module_callback_http_filter_config_define_counter(void *config, envoy_buffer name,
                                                                           envoy_buffer *labels, size_t n_labels,
                                                                           size_t *id);
WEAK extern int envoy_dynamic_module_callback_http_filter_increment_counter(void *filter, size_t id, envoy_buffer *labels,
                                                                       size_t n_labels, uint64_t value);

#define CALLBACK(name) {#name, (void *)(uintptr_t)name}
static const struct { const char *name; void *address; } CALLBACKS[] = {
    CALLBACK(envoy_dynamic_module_callback_http_get_body_chunks_size),
    CALLBACK(envoy_dynamic_module_callback_http_get_body_chunks),
    CALLBACK(envoy_dynamic_module_callback_http_received_buffered_request_body),
    CALLBACK(envoy_dynamic_module_callback_http_set_header),
    CALLBACK(envoy_dynamic_module_callback_http_clear_route_cache),
    CALLBACK(envoy_dynamic_module_callback_is_validation_mode),
    CALLBACK(envoy_dynamic_module_callback_log),
    CALLBACK(envoy_dynamic_module_callback_http_filter_config_define_counter),
    CALLBACK(envoy_dynamic_module_callback_http_filter_increment_counter),
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
  if (!pk->index || pthread_rwlock_init(&pk->lock, NULL)) {
    log_line(LOG_ERROR, "kvpilot picker: cannot allocate the index");
    kvp_index_free(pk->index);
    free(pc);
    return NULL;
  }
  pc->counters = !envoy_dynamic_module_callback_http_filter_config_define_counter(
                     config_envoy, text("kvpilot_picker_decided"), NULL, 0, &pk->counter_decided) &&
                 !envoy_dynamic_module_callback_http_filter_config_define_counter(
                     config_envoy, text("kvpilot_picker_passthrough"), NULL, 0, &pk->counter_passthrough);
  if (!envoy_dynamic_module_callback_is_validation_mode() && kvp_feed_start(pk, err, sizeof err)) {
    log_line(LOG_ERROR, err);
    pthread_rwlock_destroy(&pk->lock);
    kvp_index_free(pk->index);
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
  kvp_index_free(pc->pk.index);
  free(pc);
}

/* ---- one request ---- */
typedef struct filter {
  picker_config *pc;
  int worker; /* booked worker, -1: none */
  long prefill_booked, decode_booked;
  int decided;
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

/* The whole buffered body, copied out of Envoy's slices; NULL when over the limit. */
static char *gather_body(void *fe, size_t limit, size_t *len) {
  int types[2] = {BODY_BUFFERED_REQUEST, BODY_RECEIVED_REQUEST};
  int n_types = envoy_dynamic_module_callback_http_received_buffered_request_body(fe) ? 1 : 2;
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

static uint64_t next_random(void) {
  static __thread uint64_t state;
  if (!state && (getrandom(&state, sizeof state, 0) != sizeof state || !state)) state = 0x9E3779B97F4A7C15ULL;
  state ^= state << 13, state ^= state >> 7, state ^= state << 17;
  return state;
}

/* The chosen worker for ``ids``, or -1; its GPU overlap in ``*gpu``. */
static int choose(kvp_picker *pk, const uint32_t *ids, size_t n_ids, double *gpu) {
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
    for (uint32_t w = 0; w < n; w++) {
      kvp_tier_overlap(depths + (size_t)w * m, pk->classes, m, shared, overlap + 4 * w);
      loads[w].prefill_blocks = (double)atomic_load(&pk->workers[w].prefill_blocks);
      loads[w].decode_blocks = (double)atomic_load(&pk->workers[w].decode_blocks);
      loads[w].requests = (double)atomic_load(&pk->workers[w].requests);
      /* a candidate's decode load grows by the blocks it does not cache already (the ledger's
       * shared-decode rule, the cached prefix standing in for the active one); each request
       * books its whole prompt, as the ledger books a request's chain */
      loads[w].shared_decode_blocks = overlap[4 * w];
    }
    size_t n_ties = kvp_price(&pk->cost, blocks, n, overlap, loads, costs, ties);
    if (n_ties) {
      chosen = (int)ties[next_random() % n_ties];
      *gpu = overlap[4 * chosen];
    }
  }
  free(depths), free(overlap), free(costs), free(loads), free(ties);
  return chosen;
}

static void decide(filter *f, void *fe) {
  kvp_picker *pk = &f->pc->pk;
  size_t len = 0, n_ids = 0;
  f->decided = 1;
  char *body = gather_body(fe, pk->max_body_bytes, &len);
  size_t max_ids = len / 2 + 1 < pk->max_prompt_ids ? len / 2 + 1 : pk->max_prompt_ids;
  uint32_t *ids = body ? malloc(max_ids * sizeof *ids) : NULL;
  int worker = -1;
  double gpu = 0;
  if (ids && kvp_parse_prompt(body, len, ids, max_ids, &n_ids) == KVP_BODY_OK && n_ids)
    worker = choose(pk, ids, n_ids, &gpu);
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
  long blocks = (long)(n_ids / pk->block_size);
  f->worker = worker;
  f->prefill_booked = blocks - (long)gpu > 0 ? blocks - (long)gpu : 0;
  f->decode_booked = blocks;
  atomic_fetch_add(&w->prefill_blocks, f->prefill_booked);
  atomic_fetch_add(&w->decode_blocks, f->decode_booked);
  atomic_fetch_add(&w->requests, 1);
  count(f, fe, 1);
}

static void release_prefill(filter *f) {
  if (f->worker >= 0 && f->prefill_booked) {
    atomic_fetch_sub(&f->pc->pk.workers[f->worker].prefill_blocks, f->prefill_booked);
    f->prefill_booked = 0;
  }
}

static void release(filter *f) {
  release_prefill(f);
  if (f->worker >= 0) {
    kvp_worker *w = &f->pc->pk.workers[f->worker];
    atomic_fetch_sub(&w->decode_blocks, f->decode_booked);
    atomic_fetch_sub(&w->requests, 1);
    f->worker = -1;
  }
}

EXPORT void envoy_dynamic_module_on_http_filter_destroy(void *fm) {
  release(fm);
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

EXPORT int envoy_dynamic_module_on_http_filter_response_headers(void *fe, void *fm, bool end_of_stream) {
  (void)fe, (void)end_of_stream;
  release_prefill(fm); /* the prefill is over once the answer starts */
  return 0;
}

EXPORT void envoy_dynamic_module_on_http_filter_stream_complete(void *fe, void *fm) {
  (void)fe;
  release(fm);
}

/* Hooks Envoy requires of every HTTP filter module; this one has no use for them. */
EXPORT int envoy_dynamic_module_on_http_filter_response_body(void *fe, void *fm, bool eos) { (void)fe, (void)fm, (void)eos; return 0; }
EXPORT int envoy_dynamic_module_on_http_filter_response_trailers(void *fe, void *fm) { (void)fe, (void)fm; return 0; }
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
