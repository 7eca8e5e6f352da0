/* A bounded msgpack reader and vLLM's KV-event batch over it (kvp_wire.h). Every read checks
 * the bytes left; nesting is limited to MAX_DEPTH; a count larger than the bytes left is
 * refused before any loop runs over it. */
#include <string.h>

#include "kvp_wire.h"

#define MAX_DEPTH 32

typedef struct reader {
  const uint8_t *p, *end;
  int bad;
} reader;

static uint64_t take_be(reader *r, size_t n) {
  if (r->bad || (size_t)(r->end - r->p) < n) {
    r->bad = 1;
    return 0;
  }
  uint64_t v = 0;
  for (size_t i = 0; i < n; i++) v = v << 8 | r->p[i];
  r->p += n;
  return v;
}

static void skip_bytes(reader *r, uint64_t n) {
  if (r->bad || (uint64_t)(r->end - r->p) < n) r->bad = 1;
  else r->p += n;
}

/* A container's count; refused when it cannot fit in the bytes left (one byte an item). */
static uint64_t count_ok(reader *r, uint64_t n, int per_item) {
  if ((uint64_t)(r->end - r->p) / (uint64_t)per_item < n) r->bad = 1;
  return r->bad ? 0 : n;
}

static int is_nil(reader *r) {
  if (r->p < r->end && *r->p == 0xc0) {
    r->p++;
    return 1;
  }
  return 0;
}

static void skip(reader *r, int depth);

static void skip_items(reader *r, uint64_t n, int depth) {
  for (uint64_t i = 0; i < n && !r->bad; i++) skip(r, depth + 1);
}

static void skip(reader *r, int depth) {
  if (depth > MAX_DEPTH || r->p >= r->end) {
    r->bad = 1;
    return;
  }
  uint8_t b = *r->p++;
  if (b <= 0x7f || b >= 0xe0 || b == 0xc0 || b == 0xc2 || b == 0xc3) return;
  if ((b & 0xf0) == 0x80) return skip_items(r, count_ok(r, 2ULL * (b & 0x0f), 1), depth);
  if ((b & 0xf0) == 0x90) return skip_items(r, count_ok(r, b & 0x0f, 1), depth);
  if ((b & 0xe0) == 0xa0) return skip_bytes(r, b & 0x1f);
  switch (b) {
    case 0xc4: case 0xd9: return skip_bytes(r, take_be(r, 1));
    case 0xc5: case 0xda: return skip_bytes(r, take_be(r, 2));
    case 0xc6: case 0xdb: return skip_bytes(r, take_be(r, 4));
    case 0xc7: return skip_bytes(r, take_be(r, 1) + 1);
    case 0xc8: return skip_bytes(r, take_be(r, 2) + 1);
    case 0xc9: return skip_bytes(r, take_be(r, 4) + 1);
    case 0xcc: case 0xd0: return skip_bytes(r, 1);
    case 0xcd: case 0xd1: return skip_bytes(r, 2);
    case 0xca: case 0xce: case 0xd2: return skip_bytes(r, 4);
    case 0xcb: case 0xcf: case 0xd3: return skip_bytes(r, 8);
    case 0xd4: return skip_bytes(r, 2);
    case 0xd5: return skip_bytes(r, 3);
    case 0xd6: return skip_bytes(r, 5);
    case 0xd7: return skip_bytes(r, 9);
    case 0xd8: return skip_bytes(r, 17);
    case 0xdc: return skip_items(r, count_ok(r, take_be(r, 2), 1), depth);
    case 0xdd: return skip_items(r, count_ok(r, take_be(r, 4), 1), depth);
    case 0xde: return skip_items(r, count_ok(r, 2 * take_be(r, 2), 1), depth);
    case 0xdf: return skip_items(r, count_ok(r, 2 * take_be(r, 4), 1), depth);
    default: r->bad = 1; /* 0xc1, never used */
  }
}

/* An integer as its 64 bits (a negative int as its two's complement); 0 when not one. */
static int read_int(reader *r, uint64_t *out) {
  if (r->bad || r->p >= r->end) return r->bad = 1, 0;
  uint8_t b = *r->p;
  if (b <= 0x7f || b >= 0xe0) {
    r->p++;
    *out = (uint64_t)(int64_t)(int8_t)b & (b <= 0x7f ? 0x7f : ~0ULL);
    return 1;
  }
  static const uint8_t widths[] = {1, 2, 4, 8};
  if (b >= 0xcc && b <= 0xd3) {
    r->p++;
    size_t w = widths[(b - 0xcc) & 3];
    uint64_t v = take_be(r, w);
    if (b >= 0xd0 && w < 8 && v >> (8 * w - 1)) v |= ~0ULL << (8 * w); /* sign-extend */
    *out = v;
    return !r->bad;
  }
  return 0;
}

/* A str or bin: its bytes. */
static int read_raw(reader *r, const uint8_t **s, size_t *n) {
  if (r->bad || r->p >= r->end) return r->bad = 1, 0;
  uint8_t b = *r->p;
  uint64_t len;
  if ((b & 0xe0) == 0xa0) r->p++, len = b & 0x1f;
  else if (b == 0xd9 || b == 0xc4) r->p++, len = take_be(r, 1);
  else if (b == 0xda || b == 0xc5) r->p++, len = take_be(r, 2);
  else if (b == 0xdb || b == 0xc6) r->p++, len = take_be(r, 4);
  else return 0;
  if (r->bad || (uint64_t)(r->end - r->p) < len) return r->bad = 1, 0;
  *s = r->p;
  *n = (size_t)len;
  r->p += len;
  return 1;
}

static int read_array(reader *r, uint64_t *n) {
  if (r->bad || r->p >= r->end) return r->bad = 1, 0;
  uint8_t b = *r->p;
  if ((b & 0xf0) == 0x90) r->p++, *n = b & 0x0f;
  else if (b == 0xdc) r->p++, *n = take_be(r, 2);
  else if (b == 0xdd) r->p++, *n = take_be(r, 4);
  else return 0;
  *n = count_ok(r, *n, 1);
  return !r->bad;
}

static int read_map(reader *r, uint64_t *n) {
  if (r->bad || r->p >= r->end) return r->bad = 1, 0;
  uint8_t b = *r->p;
  if ((b & 0xf0) == 0x80) r->p++, *n = b & 0x0f;
  else if (b == 0xde) r->p++, *n = take_be(r, 2);
  else if (b == 0xdf) r->p++, *n = take_be(r, 4);
  else return 0;
  *n = count_ok(r, *n, 2);
  return !r->bad;
}

static uint64_t fnv1a(const uint8_t *s, size_t n) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (size_t i = 0; i < n; i++) h = (h ^ s[i]) * 0x100000001b3ULL;
  return h;
}

static int read_ehash(reader *r, uint64_t *out) {
  const uint8_t *s;
  size_t n;
  if (read_int(r, out)) return 1;
  if (read_raw(r, &s, &n)) return *out = fnv1a(s, n), 1;
  return 0;
}

/* ---- events ---- */
typedef struct event_fields {
  kvp_event ev;
  int tag, have_hashes, have_tokens, have_size, have_parent_field, namespaced, other_group, bad;
} event_fields;

enum { TAG_NONE, TAG_STORED, TAG_REMOVED, TAG_CLEARED };

static int str_is(const uint8_t *s, size_t n, const char *lit) {
  return n == strlen(lit) && !memcmp(s, lit, n);
}

static void field(reader *r, event_fields *f, const uint8_t *name, size_t name_len,
                  kvp_scratch *scr) {
  uint64_t n, v;
  const uint8_t *s;
  size_t len;
  if (str_is(name, name_len, "type")) {
    if (!read_raw(r, &s, &len)) return (void)(f->bad = 1);
    f->tag = str_is(s, len, "BlockStored") ? TAG_STORED : str_is(s, len, "BlockRemoved") ? TAG_REMOVED
           : str_is(s, len, "AllBlocksCleared") ? TAG_CLEARED : TAG_NONE;
  } else if (str_is(name, name_len, "block_hashes")) {
    if (!read_array(r, &n) || n > scr->max_hashes) return (void)(f->bad = 1);
    for (uint64_t i = 0; i < n; i++)
      if (!read_ehash(r, &scr->hashes[i])) return (void)(f->bad = 1);
    f->ev.ehashes = scr->hashes, f->ev.n_hashes = n, f->have_hashes = 1;
  } else if (str_is(name, name_len, "parent_block_hash")) {
    f->have_parent_field = 1;
    if (!is_nil(r)) {
      if (!read_ehash(r, &f->ev.parent)) return (void)(f->bad = 1);
      f->ev.has_parent = 1;
    }
  } else if (str_is(name, name_len, "token_ids")) {
    if (!read_array(r, &n) || n > scr->max_tokens) return (void)(f->bad = 1);
    for (uint64_t i = 0; i < n; i++) {
      if (!read_int(r, &v) || v > UINT32_MAX) return (void)(f->bad = 1);
      scr->tokens[i] = (uint32_t)v;
    }
    f->ev.tokens = scr->tokens, f->ev.n_tokens = n, f->have_tokens = 1;
  } else if (str_is(name, name_len, "block_size")) {
    if (!read_int(r, &v) || !v || v > KVP_MAX_BLOCK_SIZE) return (void)(f->bad = 1);
    f->ev.block_size = (uint32_t)v, f->have_size = 1;
  } else if (str_is(name, name_len, "medium")) {
    if (is_nil(r)) return;
    if (!read_raw(r, &s, &len)) return (void)(f->bad = 1);
    f->ev.medium = (const char *)s, f->ev.medium_len = len;
  } else if (str_is(name, name_len, "lora_name")) {
    if (!is_nil(r)) {
      if (!read_raw(r, &s, &len)) return (void)(f->bad = 1);
      f->namespaced |= len > 0;
    }
  } else if (str_is(name, name_len, "extra_keys")) {
    if (is_nil(r)) return;
    if (!read_array(r, &n)) return (void)(f->bad = 1);
    for (uint64_t i = 0; i < n && !r->bad; i++)
      if (!is_nil(r)) f->namespaced = 1, skip(r, 1);
  } else if (str_is(name, name_len, "group_idx")) {
    if (!is_nil(r)) {
      if (!read_int(r, &v)) return (void)(f->bad = 1);
      f->other_group = v != 0;
    }
  } else {
    skip(r, 1);
  }
}

/* Field names of the tagged-array form, in vLLM's order after the tag. */
static const char *const STORED_ORDER[] = {"block_hashes", "parent_block_hash", "token_ids",
                                           "block_size", "lora_id", "medium", "lora_name",
                                           "extra_keys", "group_idx"};
static const char *const REMOVED_ORDER[] = {"block_hashes", "medium", "group_idx"};

static void decode_event(reader *r, kvp_scratch *scr, kvp_event_sink sink, void *ctx,
                         kvp_batch_counts *c) {
  event_fields f;
  memset(&f, 0, sizeof f);
  f.ev.medium = "GPU", f.ev.medium_len = 3;
  const uint8_t *start = r->p;
  uint64_t n;
  if (read_map(r, &n)) {
    for (uint64_t i = 0; i < n && !r->bad && !f.bad; i++) {
      const uint8_t *name;
      size_t len;
      if (!read_raw(r, &name, &len)) f.bad = 1;
      else field(r, &f, name, len, scr);
    }
  } else if (!r->bad && read_array(r, &n) && n >= 1) {
    const uint8_t *tag;
    size_t len;
    if (read_raw(r, &tag, &len)) {
      f.tag = str_is(tag, len, "BlockStored") ? TAG_STORED : str_is(tag, len, "BlockRemoved") ? TAG_REMOVED
            : str_is(tag, len, "AllBlocksCleared") ? TAG_CLEARED : TAG_NONE;
      const char *const *order = f.tag == TAG_STORED ? STORED_ORDER : REMOVED_ORDER;
      size_t known = f.tag == TAG_STORED ? 9 : f.tag == TAG_REMOVED ? 3 : 0;
      for (uint64_t i = 1; i < n && !r->bad && !f.bad; i++) {
        if (i - 1 < known) field(r, &f, (const uint8_t *)order[i - 1], strlen(order[i - 1]), scr);
        else skip(r, 1);
      }
    } else {
      f.bad = 1;
    }
  } else {
    f.bad = 1;
  }
  if (r->bad) return;
  if (f.bad) { /* skip what is left of this event: restart from its first byte */
    r->p = start;
    skip(r, 1);
    c->rejected++;
    return;
  }
  if (f.tag == TAG_STORED && (!f.have_hashes || !f.have_tokens || !f.have_size || !f.have_parent_field ||
                              f.ev.n_tokens != f.ev.n_hashes * f.ev.block_size)) f.tag = TAG_NONE;
  if (f.tag == TAG_REMOVED && !f.have_hashes) f.tag = TAG_NONE;
  if (f.tag == TAG_NONE) {
    c->rejected++;
  } else if (f.other_group && f.tag != TAG_CLEARED) {
    c->skipped_group++;
  } else if (f.namespaced && f.tag == TAG_STORED) {
    c->skipped_namespace++;
  } else {
    f.ev.kind = f.tag == TAG_STORED ? KVP_EV_STORED : f.tag == TAG_REMOVED ? KVP_EV_REMOVED : KVP_EV_CLEARED;
    c->events++;
    sink(ctx, &f.ev);
  }
}

int kvp_decode_batch(const uint8_t *buf, size_t len, kvp_scratch *scratch, kvp_event_sink sink,
                     void *ctx, kvp_batch_counts *counts) {
  reader whole = {buf, buf + len, 0};
  skip(&whole, 0); /* the batch is well-formed msgpack before any event is applied */
  if (whole.bad || whole.p != whole.end) return KVP_BATCH_UNDECODABLE;
  reader r = {buf, buf + len, 0};
  uint64_t n, events;
  if (!read_array(&r, &n) || n < 2 || n > 3) return KVP_BATCH_UNDECODABLE;
  skip(&r, 1); /* ts */
  if (!read_array(&r, &events)) return KVP_BATCH_UNDECODABLE;
  for (uint64_t i = 0; i < events && !r.bad; i++) decode_event(&r, scratch, sink, ctx, counts);
  return r.bad ? KVP_BATCH_UNDECODABLE : KVP_BATCH_OK;
}
