/* What crosses into the compiled decision from outside: a request body's token-id prompt
 * (kvp_body.c) and a KV-event batch (kvp_msgpack.c, vLLM's wire format as
 * routing/index/events.py restates it). Both parsers are total: every input, however hostile,
 * returns a status; none reads past ``len`` or writes past the caller's limits. */
#ifndef KVP_WIRE_H
#define KVP_WIRE_H

#include <stddef.h>
#include <stdint.h>

#include "kvp_core.h"

/* ---- request bodies ---- */
enum kvp_body_status {
  KVP_BODY_OK = 0,
  KVP_BODY_MALFORMED = 1,      /* not a JSON object, or nested deeper than the limit */
  KVP_BODY_NO_PROMPT = 2,      /* no top-level "prompt" */
  KVP_BODY_NOT_TOKEN_IDS = 3,  /* "prompt" is text, a batch, or ids outside [0, 2**32) */
  KVP_BODY_TOO_MANY_IDS = 4,   /* more ids than the caller's limit */
  KVP_BODY_NAMESPACED = 5,     /* a cache_salt, or a model other than the served one (a LoRA
                                 adapter's namespace): not the default namespace */
  KVP_BODY_SESSION_FIELD = 6,  /* a session named in the body (sessions.py's SESSION_FIELDS), which
                                 the Python picker strips before the engines see it */
  KVP_BODY_FIELD = 7,          /* a top-level field outside the accepted ones: the Python picker
                                 refuses it by name (request_fields.py) or reads it (nvext) */
};

/* The token ids of a top-level ``"prompt": [ids]`` of the JSON object ``body``, up to
 * ``max_ids`` into ``ids`` (their count in ``*n_ids``, 0 unless KVP_BODY_OK). A top-level
 * ``"cache_salt"`` that is a non-empty string, or (``served_model`` not NULL) a top-level
 * ``"model"`` that is not exactly ``served_model``, makes it KVP_BODY_NAMESPACED; a top-level
 * ``"conversation_id"`` or ``"prompt_cache_key"`` other than null, KVP_BODY_SESSION_FIELD; a
 * top-level key (as written, escapes and all) that is not one of ``accepted``'s names
 * (newline-separated; NULL: no field is checked), KVP_BODY_FIELD. Returns an enum
 * kvp_body_status. */
KVP_API int kvp_parse_prompt(const char *body, size_t len, const char *served_model, const char *accepted,
                             uint32_t *ids, size_t max_ids, size_t *n_ids);

/* ---- KV-event batches ---- */
enum kvp_batch_status { KVP_BATCH_OK = 0, KVP_BATCH_UNDECODABLE = 1 };

/* One decoded event, valid during the sink's call only. */
typedef struct kvp_event {
  enum { KVP_EV_STORED, KVP_EV_REMOVED, KVP_EV_CLEARED } kind;
  const uint64_t *ehashes; /* engine hashes: ints as is, bytes by their FNV-1a 64 */
  size_t n_hashes;
  int has_parent;
  uint64_t parent;
  const uint32_t *tokens;
  size_t n_tokens;
  uint32_t block_size;
  const char *medium; /* not NUL-terminated; "GPU" when the event names none */
  size_t medium_len;
} kvp_event;

typedef void (*kvp_event_sink)(void *ctx, const kvp_event *ev);

/* Scratch space the decoder fills (an event beyond it is rejected, not truncated). */
typedef struct kvp_scratch {
  uint64_t *hashes;
  size_t max_hashes;
  uint32_t *tokens;
  size_t max_tokens;
} kvp_scratch;

/* Counts of what a batch carried. */
typedef struct kvp_batch_counts {
  uint64_t events, rejected, skipped_namespace, skipped_group;
} kvp_batch_counts;

/* Decode one batch ``[ts, [event, ...], rank?]`` (events as tagged maps or tagged arrays)
 * and hand each good event of KV group 0 in the default namespace to ``sink``, in order; a
 * bad event is counted and the ones around it kept. Returns an enum kvp_batch_status. */
KVP_API int kvp_decode_batch(const uint8_t *buf, size_t len, kvp_scratch *scratch,
                             kvp_event_sink sink, void *ctx, kvp_batch_counts *counts);

#endif
