/* The token-id prompt of an OpenAI completions body (kvp_wire.h): a bounded JSON scanner
 * that reads the top-level object's keys, the "prompt" array of integers, the "cache_salt",
 * the "model", the session fields, and skips every other value (strings with escapes, numbers, literals, containers nested at
 * most MAX_DEPTH deep) without building anything. */
#include <string.h>

#include "kvp_wire.h"

#define MAX_DEPTH 64

typedef struct scan {
  const char *p, *end;
} scan;

static inline int space(char c) { return c == ' ' || c == '\n' || c == '\r' || c == '\t'; }

static inline int digit(char c) { return (unsigned char)(c - '0') < 10; }

static void ws(scan *s) {
  while (s->p < s->end && space(*s->p)) s->p++;
}

static int eat(scan *s, char c) {
  ws(s);
  if (s->p < s->end && *s->p == c) return s->p++, 1;
  return 0;
}

/* A string: its raw bytes between the quotes (escapes left as they are). */
static int string(scan *s, const char **start, size_t *len) {
  if (!eat(s, '"')) return 0;
  const char *b = s->p;
  while (s->p < s->end && *s->p != '"') {
    if (*s->p == '\\' && ++s->p == s->end) return 0;
    if ((unsigned char)*s->p < 0x20) return 0;
    s->p++;
  }
  if (s->p == s->end) return 0;
  *start = b, *len = (size_t)(s->p - b);
  s->p++;
  return 1;
}

static int value(scan *s, int depth);

static int container(scan *s, char close, int is_object, int depth) {
  if (depth > MAX_DEPTH) return 0;
  if (eat(s, close)) return 1;
  do {
    const char *k;
    size_t n;
    if (is_object && (!string(s, &k, &n) || !eat(s, ':'))) return 0;
    if (!value(s, depth + 1)) return 0;
  } while (eat(s, ','));
  return eat(s, close);
}

static int value(scan *s, int depth) {
  ws(s);
  if (s->p >= s->end) return 0;
  const char *k;
  size_t n;
  switch (*s->p) {
    case '{': s->p++; return container(s, '}', 1, depth);
    case '[': s->p++; return container(s, ']', 0, depth);
    case '"': return string(s, &k, &n);
    default: {
      const char *b = s->p;
      while (s->p < s->end && (digit(*s->p) || *s->p == '+' || *s->p == '-' || *s->p == '.' ||
                               (*s->p >= 'a' && *s->p <= 'z') || *s->p == 'E'))
        s->p++;
      return s->p > b;
    }
  }
}

/* "prompt"'s array of token ids; KVP_BODY_OK or why not. One pass, no call per id. */
static int ids(scan *s, uint32_t *out, size_t max, size_t *count) {
  if (!eat(s, '[')) return value(s, 1) ? KVP_BODY_NOT_TOKEN_IDS : KVP_BODY_MALFORMED;
  const char *p = s->p, *end = s->end;
  size_t n = 0;
  while (p < end && space(*p)) p++;
  if (p < end && *p == ']') {
    s->p = p + 1;
    return *count = 0, KVP_BODY_OK;
  }
  for (;;) {
    while (p < end && space(*p)) p++;
    const char *first = p;
    uint64_t v = 0;
    while (p < end && digit(*p)) v = v * 10 + (uint64_t)(*p++ - '0'); /* wraps past 19 digits */
    if (p == first || p - first > 10 || v > UINT32_MAX || (p < end && (*p == '.' || *p == 'e' || *p == 'E')))
      return KVP_BODY_NOT_TOKEN_IDS;
    if (n == max) return KVP_BODY_TOO_MANY_IDS;
    out[n++] = (uint32_t)v;
    while (p < end && space(*p)) p++;
    if (p < end && *p == ',') {
      p++;
      continue;
    }
    s->p = p;
    *count = n;
    return p < end && *p == ']' ? (s->p++, KVP_BODY_OK) : KVP_BODY_MALFORMED;
  }
}

/* Whether the key ``k`` (``n`` bytes) is one of ``accepted``'s newline-separated names. */
static int accepted_key(const char *accepted, const char *k, size_t n) {
  for (const char *name = accepted; *name;) {
    const char *end = strchr(name, '\n');
    size_t len = end ? (size_t)(end - name) : strlen(name);
    if (len == n && !memcmp(name, k, n)) return 1;
    name += len + (end != NULL);
  }
  return 0;
}

static int parse(const char *body, size_t len, const char *served_model, const char *accepted, uint32_t *out,
                 size_t max_ids, size_t *n_ids) {
  scan s = {body, body + len};
  int found = 0, salted = 0, session = 0, other_model = 0, refused = 0;
  *n_ids = 0;
  if (!eat(&s, '{')) return KVP_BODY_MALFORMED;
  if (!eat(&s, '}')) {
    do {
      const char *k;
      size_t n;
      if (!string(&s, &k, &n) || !eat(&s, ':')) return KVP_BODY_MALFORMED;
      refused |= accepted && !accepted_key(accepted, k, n);
      if (n == 6 && !memcmp(k, "prompt", 6)) {
        int status = ids(&s, out, max_ids, n_ids);
        if (status != KVP_BODY_OK) return status;
        found = 1;
      } else if (n == 10 && !memcmp(k, "cache_salt", 10)) {
        const char *v;
        size_t vn;
        ws(&s);
        if (s.p < s.end && *s.p == '"') {
          if (!string(&s, &v, &vn)) return KVP_BODY_MALFORMED;
          salted |= vn > 0;
        } else if (!value(&s, 1)) {
          return KVP_BODY_MALFORMED;
        }
      } else if (n == 5 && !memcmp(k, "model", 5) && served_model) {
        const char *v;
        size_t vn;
        ws(&s);
        if (s.p < s.end && *s.p == '"') {
          if (!string(&s, &v, &vn)) return KVP_BODY_MALFORMED;
          other_model |= vn != strlen(served_model) || memcmp(v, served_model, vn);
        } else if (value(&s, 1)) {
          other_model = 1;
        } else {
          return KVP_BODY_MALFORMED;
        }
      } else if ((n == 15 && !memcmp(k, "conversation_id", 15)) || (n == 16 && !memcmp(k, "prompt_cache_key", 16))) {
        ws(&s);
        const char *v = s.p;
        if (!value(&s, 1)) return KVP_BODY_MALFORMED;
        session |= !(s.p - v == 4 && !memcmp(v, "null", 4));
      } else if (!value(&s, 1)) {
        return KVP_BODY_MALFORMED;
      }
    } while (eat(&s, ','));
    if (!eat(&s, '}')) return KVP_BODY_MALFORMED;
  }
  ws(&s);
  if (s.p != s.end) return KVP_BODY_MALFORMED;
  if (refused) return KVP_BODY_FIELD;
  if (salted || other_model) return KVP_BODY_NAMESPACED;
  if (session) return KVP_BODY_SESSION_FIELD;
  return found ? KVP_BODY_OK : KVP_BODY_NO_PROMPT;
}

int kvp_parse_prompt(const char *body, size_t len, const char *served_model, const char *accepted, uint32_t *ids,
                     size_t max_ids, size_t *n_ids) {
  int status = parse(body, len, served_model, accepted, ids, max_ids, n_ids);
  if (status != KVP_BODY_OK) *n_ids = 0;
  return status;
}
