/* kvp_answer.h: one JSON object's top-level members found by a balanced scan that respects
 * strings and their escapes (deploy/envoy_lua.py's parser), then the object rebuilt from the
 * members it keeps, each as written. */
#include "kvp_answer.h"

#include <stdlib.h>
#include <string.h>

const char kvp_withheld_chunk[] =
    "{\"error\": {\"message\": \"kvpilot: the engine's streamed chunk names kv_transfer_params but is not a JSON "
    "object; withheld\", \"type\": \"upstream_error\", \"code\": 502}}";
const char kvp_withheld_answer[] =
    "{\"error\": {\"message\": \"kvpilot: the engine's answer is not a JSON object; withheld\", \"type\": "
    "\"upstream_error\", \"code\": 502}}";

#define KEY_LEN (sizeof KVP_WITHHELD_KEY - 1)
#define PREFIX_LEN (sizeof KVP_WITHHELD_PREFIX - 1)

typedef struct text {
  char *p;
  size_t len, cap;
} text;

static int put(text *t, const char *s, size_t n) {
  if (t->len + n + 1 > t->cap) {
    size_t cap = (t->len + n + 1) * 2;
    char *p = realloc(t->p, cap);
    if (!p) return -1;
    t->p = p, t->cap = cap;
  }
  if (n) memcpy(t->p + t->len, s, n);
  t->len += n;
  t->p[t->len] = 0;
  return 0;
}

static int blank(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\v' || c == '\f' || c == '\r'; }

static const char *skip_blank(const char *p, const char *end) {
  while (p < end && blank(*p)) p++;
  return p;
}

/* The quote closing the string whose opening quote is at p (NULL: none). */
static const char *string_end(const char *p, const char *end) {
  for (const char *j = p + 1;;) {
    const char *k = memchr(j, '"', (size_t)(end - j));
    if (!k) return NULL;
    const char *b = k - 1;
    while (*b == '\\') b--; /* stops at the opening quote at the latest */
    if ((k - 1 - b) % 2 == 0) return k;
    j = k + 1;
  }
}

/* The last byte of the JSON value starting at p (NULL: malformed or empty). */
static const char *value_end(const char *p, const char *end) {
  if (*p == '"') return string_end(p, end);
  if (*p != '{' && *p != '[') { /* a number or literal: up to what follows it */
    const char *k = p;
    while (k < end && *k != ',' && *k != '}' && !blank(*k)) k++;
    return k == p || k == end ? NULL : k - 1;
  }
  long depth = 0;
  for (const char *k = p; k < end; k++) {
    if (*k == '"') {
      if (!(k = string_end(k, end))) return NULL;
    } else if (*k == '{' || *k == '[') {
      depth++;
    } else if (*k == '}' || *k == ']') {
      if (--depth == 0) return k;
    }
  }
  return NULL;
}

typedef enum { KEEP, DROP, NULLED } fate;

static fate fate_of(const char *key, size_t n) {
  if (n == KEY_LEN && !memcmp(key, KVP_WITHHELD_KEY, KEY_LEN)) return NULLED;
  if (n >= PREFIX_LEN && !memcmp(key, KVP_WITHHELD_PREFIX, PREFIX_LEN)) return DROP;
  return KEEP;
}

/* s without its withheld members; the withheld key's value "null" when null_key, else the
 * member dropped. */
static int scrub_object(const char *s, size_t n, int null_key, text *out) {
  const char *end = s + n, *j = skip_blank(s, end);
  if (j == end || *j != '{') return KVP_SCRUB_UNREADABLE;
  j = skip_blank(j + 1, end);
  int changed = 0, kept = 0;
  if (put(out, "{", 1)) return KVP_SCRUB_NO_MEMORY;
  if (j < end && *j == '}') return skip_blank(j + 1, end) == end ? KVP_SCRUB_UNCHANGED : KVP_SCRUB_UNREADABLE;
  while (j < end && *j == '"') {
    const char *key_end = string_end(j, end);
    if (!key_end) return KVP_SCRUB_UNREADABLE;
    const char *colon = skip_blank(key_end + 1, end);
    if (colon == end || *colon != ':') return KVP_SCRUB_UNREADABLE;
    const char *v = skip_blank(colon + 1, end);
    const char *v_end = v < end ? value_end(v, end) : NULL;
    if (!v_end) return KVP_SCRUB_UNREADABLE;
    fate f = fate_of(j + 1, (size_t)(key_end - j - 1));
    int fail = 0;
    if (f == KEEP || (f == NULLED && null_key)) {
      fail |= kept++ && put(out, ",", 1);
      fail |= f == KEEP ? put(out, j, (size_t)(v_end + 1 - j)) : put(out, j, (size_t)(v - j)) || put(out, "null", 4);
    }
    if (fail) return KVP_SCRUB_NO_MEMORY;
    changed |= f != KEEP;
    j = skip_blank(v_end + 1, end);
    if (j == end) return KVP_SCRUB_UNREADABLE;
    if (*j == '}') {
      if (skip_blank(j + 1, end) != end) return KVP_SCRUB_UNREADABLE;
      if (put(out, "}", 1)) return KVP_SCRUB_NO_MEMORY;
      return changed ? KVP_SCRUB_CHANGED : KVP_SCRUB_UNCHANGED;
    }
    if (*j != ',') return KVP_SCRUB_UNREADABLE;
    j = skip_blank(j + 1, end);
  }
  return KVP_SCRUB_UNREADABLE;
}

int kvp_names_withheld(const char *s, size_t n) {
  return memmem(s, n, KVP_WITHHELD_KEY, KEY_LEN) || memmem(s, n, KVP_WITHHELD_PREFIX, PREFIX_LEN);
}

static int hand_over(int rc, text *t, char **out, size_t *out_len) {
  if (rc == KVP_SCRUB_CHANGED) {
    *out = t->p, *out_len = t->len;
    return rc;
  }
  free(t->p);
  return rc;
}

int kvp_scrub_answer(const char *s, size_t n, char **out, size_t *out_len) {
  if (!kvp_names_withheld(s, n)) return KVP_SCRUB_UNCHANGED;
  text t = {0};
  return hand_over(scrub_object(s, n, 1, &t), &t, out, out_len);
}

/* One "data:" line's JSON (no line end) as the client gets it, appended to out. */
static int scrub_data_line(const char *line, size_t n, text *out) {
  size_t cr = n && line[n - 1] == '\r';
  size_t head = n > 5 && line[5] == ' ' ? 6 : 5;
  text t = {0};
  int rc = scrub_object(line + head, n - cr - head, 0, &t);
  int fail = put(out, line, head);
  if (rc == KVP_SCRUB_CHANGED) fail |= put(out, t.p, t.len);
  else if (rc == KVP_SCRUB_UNCHANGED) fail |= put(out, line + head, n - cr - head);
  else if (rc == KVP_SCRUB_UNREADABLE) fail |= put(out, kvp_withheld_chunk, sizeof kvp_withheld_chunk - 1);
  free(t.p);
  if (cr) fail |= put(out, "\r", 1);
  return rc == KVP_SCRUB_NO_MEMORY || fail ? KVP_SCRUB_NO_MEMORY : KVP_SCRUB_CHANGED;
}

/* Complete lines (s ends with a line end), each data line's JSON rid of the withheld keys. */
static int scrub_lines(const char *s, size_t n, text *out) {
  const char *end = s + n;
  for (const char *from = s; from < end;) {
    const char *nl = memchr(from, '\n', (size_t)(end - from));
    size_t len = (size_t)((nl ? nl : end) - from);
    int rc = len >= 5 && !memcmp(from, "data:", 5) && kvp_names_withheld(from, len) ? scrub_data_line(from, len, out)
                                                                                   : put(out, from, len);
    if (rc < 0 || (nl && put(out, "\n", 1))) return KVP_SCRUB_NO_MEMORY;
    from += len + 1;
  }
  return KVP_SCRUB_CHANGED;
}

int kvp_stream_feed(kvp_stream *st, const char *chunk, size_t n, char **out, size_t *out_len) {
  if (!st->len && (!n || (chunk[n - 1] == '\n' && !kvp_names_withheld(chunk, n)))) return KVP_SCRUB_UNCHANGED;
  text all = {st->carry, st->len, st->cap};
  st->carry = NULL, st->len = st->cap = 0;
  if (put(&all, chunk, n)) return free(all.p), KVP_SCRUB_NO_MEMORY;
  const char *last = memrchr(all.p, '\n', all.len);
  size_t lines = last ? (size_t)(last + 1 - all.p) : 0;
  text t = {0};
  int rc = KVP_SCRUB_CHANGED;
  if (lines && kvp_names_withheld(all.p, lines)) rc = scrub_lines(all.p, lines, &t);
  else if (put(&t, all.p, lines)) rc = KVP_SCRUB_NO_MEMORY;
  if (rc < 0) return free(all.p), free(t.p), rc;
  memmove(all.p, all.p + lines, all.len - lines); /* what follows the last line end waits */
  st->carry = all.p, st->len = all.len - lines, st->cap = all.cap;
  if (t.len == n && (!n || !memcmp(t.p, chunk, n))) return free(t.p), KVP_SCRUB_UNCHANGED;
  if (!t.p && put(&t, "", 0)) return KVP_SCRUB_NO_MEMORY;
  *out = t.p, *out_len = t.len;
  return KVP_SCRUB_CHANGED;
}

void kvp_stream_clear(kvp_stream *st) {
  free(st->carry);
  st->carry = NULL, st->len = st->cap = 0;
}

kvp_stream *kvp_stream_new(void) { return calloc(1, sizeof(kvp_stream)); }

void kvp_stream_free(kvp_stream *st) {
  if (st) kvp_stream_clear(st);
  free(st);
}

void kvp_free(void *p) { free(p); }
