/* What no client reads of an engine's answer, rid of it in C (routing/serve/withheld.py's
 * rules, as Envoy's Lua filter applies them: deploy/envoy_lua.py): a whole JSON answer keeps
 * its top-level "kv_transfer_params" as null and loses every top-level "kvpilot_*" member; a
 * stream's "data:" lines lose both, a line whose JSON names one but cannot be read becomes
 * KVP_WITHHELD_CHUNK. Pure: no I/O, clock, thread or global state; every function bounds its
 * reads by the length it is given and reports a refusal as a return code. */
#ifndef KVP_ANSWER_H
#define KVP_ANSWER_H

#include <stddef.h>

#include "kvp_core.h"

#define KVP_WITHHELD_KEY "kv_transfer_params"
#define KVP_WITHHELD_PREFIX "kvpilot_"

/* routing/serve/withheld.py's WITHHELD_CHUNK and WITHHELD_ANSWER, byte for byte (a unit test
 * compares them). */
KVP_API extern const char kvp_withheld_chunk[];
KVP_API extern const char kvp_withheld_answer[];

enum kvp_scrubbed {
  KVP_SCRUB_NO_MEMORY = -2,
  KVP_SCRUB_UNREADABLE = -1, /* it names a withheld key and is not one JSON object */
  KVP_SCRUB_UNCHANGED = 0,   /* pass it on as it came */
  KVP_SCRUB_CHANGED = 1,     /* pass *out on instead (malloc'd, the caller frees it) */
};

/* 1 when s's text names a withheld key anywhere (a substring test, the whole cost of a clean
 * answer), else 0. */
KVP_API int kvp_names_withheld(const char *s, size_t n);

/* A whole answer as the client gets it. */
KVP_API int kvp_scrub_answer(const char *s, size_t n, char **out, size_t *out_len);

/* A stream's state between its chunks: its last partial line, kept until a line end comes, so
 * that a key split between two chunks is still found. */
typedef struct kvp_stream {
  char *carry;
  size_t len, cap;
} kvp_stream;

/* One chunk of a stream: UNCHANGED (pass it), CHANGED (pass *out instead: the chunk's
 * complete lines, scrubbed, after what was carried; possibly empty) or NO_MEMORY. A chunk that
 * ends a line and names no key is passed with no copy. A stream that ends inside a line loses
 * that line, as an SSE client drops an event no blank line ended. */
KVP_API int kvp_stream_feed(kvp_stream *st, const char *chunk, size_t n, char **out, size_t *out_len);
KVP_API void kvp_stream_clear(kvp_stream *st);

/* For bindings: a new stream state, freed with kvp_stream_free; free() for *out. */
KVP_API kvp_stream *kvp_stream_new(void);
KVP_API void kvp_stream_free(kvp_stream *st);
KVP_API void kvp_free(void *p);

#endif
