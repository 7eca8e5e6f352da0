/* The picker's state shared by Envoy's worker threads (kvp_module.c) and the feeder thread
 * (kvp_feed.c). The index is written by the feeder only, under ``lock`` held for writing one
 * batch; requests read it under the lock held for reading. What requests book (each worker's
 * prefill blocks and requests, the active-block ledger, the sessions) is read and written
 * under ``book_lock`` only. Everything else is set once by the config hook and read-only
 * afterwards. */
#ifndef KVP_MODULE_H
#define KVP_MODULE_H

#include <pthread.h>
#include <stdatomic.h>

#include "kvp_core.h"
#include "kvp_wire.h"

#define KVP_MAX_WORKERS 256
#define KVP_NAME_MAX 256
#define KVP_FIELDS_MAX 4096

typedef struct kvp_worker {
  char destination[KVP_NAME_MAX]; /* host:port, the header's value; beside Dynamo its instance id */
  char endpoint[KVP_NAME_MAX];    /* the engine's KV-event socket */
  int bind;                       /* 1: the engine connects and we bind; 0: we connect */
  long prefill_blocks, requests; /* booked, under book_lock */
  uint64_t last_seq;
  int seen_seq;
} kvp_worker;

typedef struct kvp_picker {
  kvp_index *index;
  pthread_rwlock_t lock;
  uint32_t block_size, n_workers, n_media;
  kvp_worker workers[KVP_MAX_WORKERS];
  char media[KVP_MAX_MEDIA][32];
  uint8_t classes[KVP_MAX_MEDIA];
  kvp_cost_config cost;
  /* what requests book, under book_lock */
  pthread_mutex_t book_lock;
  kvp_ledger *ledger;
  kvp_sessions *sessions;
  uint32_t max_sessions;
  double session_resident_s;
  uint64_t session_seed; /* keys sessions by their names, unguessably */
  char topic[64];
  char libzmq[512];
  char dynamo_frontend[KVP_NAME_MAX]; /* set: every request goes there, naming its worker's instance */
  char model[KVP_NAME_MAX];           /* set: only bodies naming this model are decided */
  char fields[KVP_FIELDS_MAX];        /* the top-level fields a decided body may have, newline-separated */
  size_t max_body_bytes, max_prompt_ids, max_event_tokens;
  /* the feeder */
  pthread_t feeder;
  int feeder_started;
  atomic_int stop;
  atomic_ulong batches, bad_frames, restarts, events_applied, events_skipped;
  /* Envoy's counters and the decision histogram (ids from define_counter, define_histogram) */
  size_t counter_decided, counter_passthrough, histogram_decision;
} kvp_picker;

/* Parse the filter config (README.md); on error write a message to ``err`` and return -1. */
int kvp_config_parse(kvp_picker *pk, const char *text, size_t len, char *err, size_t err_len);

/* Start the feeder thread subscribing to every worker's endpoint (none configured: no
 * thread). Returns 0, or -1 with a message in ``err``. */
int kvp_feed_start(kvp_picker *pk, char *err, size_t err_len);
/* Stop and join the feeder (no-op when not started). */
void kvp_feed_stop(kvp_picker *pk);

#endif
