/* Block naming, the block index and the prefix match (kvp_core.h). Same outcomes as
 * routing/index/block_index.py for the default namespace: a slot is (worker, medium); per
 * key, the bits of the slots holding it; per worker, engine hash -> (key, position). */
#include <stdlib.h>
#include <string.h>

#include "kvp_core.h"

#define OCCUPIED (1ULL << 63)
#define KEY_MASK ((1ULL << KVP_KEY_BITS) - 1)
#define FINAL_MULTIPLIER 0xFF51AFD7ED558CCDULL

typedef struct name_entry {
  uint64_t ehash, key, pos; /* pos | OCCUPIED when used */
} name_entry;

typedef struct name_table {
  name_entry *slots;
  size_t cap, used;
} name_table;

struct kvp_index {
  uint32_t block_size, max_workers, n_media, words;
  uint64_t position_lane;
  uint64_t *lanes;
  uint64_t *keys; /* cap rows of (1 + words): key | OCCUPIED, then the slots' bits */
  size_t cap, used;
  name_table *names;  /* per worker */
  uint8_t *slot_seen; /* per slot: stored in at least once */
};

static inline size_t mix(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  return (size_t)x;
}

kvp_index *kvp_index_new(uint32_t block_size, uint32_t max_workers, uint32_t n_media,
                         const uint64_t *lanes, uint64_t position_lane) {
  if (!block_size || block_size > KVP_MAX_BLOCK_SIZE || !n_media || n_media > KVP_MAX_MEDIA ||
      !max_workers || (uint64_t)max_workers * n_media > KVP_MAX_SLOTS || !lanes)
    return NULL;
  kvp_index *ix = calloc(1, sizeof *ix);
  if (!ix) return NULL;
  ix->block_size = block_size;
  ix->max_workers = max_workers;
  ix->n_media = n_media;
  ix->words = (max_workers * n_media + 63) / 64;
  ix->position_lane = position_lane;
  ix->cap = 1024;
  ix->lanes = malloc(block_size * sizeof *ix->lanes);
  ix->keys = calloc(ix->cap * (1 + ix->words), sizeof *ix->keys);
  ix->names = calloc(max_workers, sizeof *ix->names);
  ix->slot_seen = calloc((size_t)max_workers * n_media, 1);
  if (!ix->lanes || !ix->keys || !ix->names || !ix->slot_seen) {
    kvp_index_free(ix);
    return NULL;
  }
  memcpy(ix->lanes, lanes, block_size * sizeof *lanes);
  return ix;
}

void kvp_index_free(kvp_index *ix) {
  if (!ix) return;
  if (ix->names)
    for (uint32_t w = 0; w < ix->max_workers; w++) free(ix->names[w].slots);
  free(ix->names);
  free(ix->lanes);
  free(ix->keys);
  free(ix->slot_seen);
  free(ix);
}

/* ---- naming (chain.py's block_hashes and chain_from_hashes) ---- */
static inline uint64_t block_hash(const kvp_index *ix, const uint32_t *t, uint64_t pos) {
  uint64_t h = 0;
  for (uint32_t i = 0; i < ix->block_size; i++) h += (uint64_t)t[i] * ix->lanes[i];
  h += pos * ix->position_lane;
  h ^= h >> 32;
  h *= FINAL_MULTIPLIER;
  h ^= h >> 29;
  return h & KEY_MASK;
}

void kvp_chain_keys(const kvp_index *ix, const uint32_t *tokens, size_t n_blocks,
                    uint64_t first_pos, uint64_t parent, uint64_t *out) {
  for (size_t j = 0; j < n_blocks; j++) {
    parent ^= block_hash(ix, tokens + j * ix->block_size, first_pos + j);
    out[j] = parent;
  }
}

/* ---- key -> slot bits (open addressing, linear probing, backward-shift deletion) ---- */
static inline uint64_t *key_row(const kvp_index *ix, size_t i) {
  return ix->keys + i * (1 + ix->words);
}

static size_t key_find(const kvp_index *ix, uint64_t key) { /* its row, or an empty row */
  size_t i = mix(key) & (ix->cap - 1);
  for (;;) {
    uint64_t tag = key_row(ix, i)[0];
    if (!tag || tag == (key | OCCUPIED)) return i;
    i = (i + 1) & (ix->cap - 1);
  }
}

static int key_grow(kvp_index *ix) {
  size_t old_cap = ix->cap, stride = 1 + ix->words;
  uint64_t *old = ix->keys;
  uint64_t *grown = calloc(old_cap * 2 * stride, sizeof *grown);
  if (!grown) return -1;
  ix->keys = grown;
  ix->cap = old_cap * 2;
  for (size_t i = 0; i < old_cap; i++) {
    const uint64_t *row = old + i * stride;
    if (row[0]) memcpy(key_row(ix, key_find(ix, row[0] & KEY_MASK)), row, stride * 8);
  }
  free(old);
  return 0;
}

static void key_delete(kvp_index *ix, size_t hole) {
  size_t stride = 1 + ix->words, i = hole;
  for (;;) {
    i = (i + 1) & (ix->cap - 1);
    uint64_t *row = key_row(ix, i);
    if (!row[0]) break;
    size_t home = mix(row[0] & KEY_MASK) & (ix->cap - 1);
    /* move row i into the hole unless its home lies cyclically in (hole, i] */
    if ((i > hole && (home <= hole || home > i)) || (i < hole && home <= hole && home > i)) {
      memcpy(key_row(ix, hole), row, stride * 8);
      hole = i;
    }
  }
  memset(key_row(ix, hole), 0, stride * 8);
  ix->used--;
}

/* ---- per worker: engine hash -> (key, position) ---- */
static name_entry *name_find(const name_table *t, uint64_t ehash) {
  if (!t->cap) return NULL;
  size_t i = mix(ehash) & (t->cap - 1);
  for (;;) {
    name_entry *e = &t->slots[i];
    if (!e->pos || e->ehash == ehash) return e;
    i = (i + 1) & (t->cap - 1);
  }
}

static int name_put(name_table *t, uint64_t ehash, uint64_t key, uint64_t pos) {
  if ((t->used + 1) * 10 > t->cap * 7) {
    size_t cap = t->cap ? t->cap * 2 : 64;
    name_entry *old = t->slots, *grown = calloc(cap, sizeof *grown);
    if (!grown) return -1;
    size_t old_cap = t->cap;
    t->slots = grown;
    t->cap = cap;
    for (size_t i = 0; i < old_cap; i++)
      if (old[i].pos) *name_find(t, old[i].ehash) = old[i];
    free(old);
  }
  name_entry *e = name_find(t, ehash);
  if (!e->pos) t->used++;
  e->ehash = ehash;
  e->key = key;
  e->pos = pos | OCCUPIED;
  return 0;
}

static void name_delete(name_table *t, name_entry *e) {
  size_t hole = (size_t)(e - t->slots), i = hole;
  for (;;) {
    i = (i + 1) & (t->cap - 1);
    if (!t->slots[i].pos) break;
    size_t home = mix(t->slots[i].ehash) & (t->cap - 1);
    if ((i > hole && (home <= hole || home > i)) || (i < hole && home <= hole && home > i)) {
      t->slots[hole] = t->slots[i];
      hole = i;
    }
  }
  memset(&t->slots[hole], 0, sizeof t->slots[hole]);
  t->used--;
}

/* ---- events ---- */
int kvp_index_store(kvp_index *ix, uint32_t worker, uint32_t medium, const uint64_t *ehashes,
                    size_t n, int has_parent, uint64_t parent_ehash, uint32_t event_block_size,
                    const uint32_t *tokens, size_t n_tokens) {
  if (worker >= ix->max_workers || medium >= ix->n_media) return KVP_SKIP_UNKNOWN_SLOT;
  if (event_block_size != ix->block_size) return KVP_SKIP_BLOCK_SIZE;
  if (n_tokens != n * ix->block_size || n_tokens / ix->block_size != n) return KVP_SKIP_BAD_SHAPE;
  name_table *names = &ix->names[worker];
  uint64_t parent = 0, pos0 = 0;
  if (has_parent) {
    name_entry *known = name_find(names, parent_ehash);
    if (!known || !known->pos) return KVP_SKIP_UNKNOWN_PARENT;
    parent = known->key;
    pos0 = (known->pos & ~OCCUPIED) + 1;
  }
  uint32_t slot = worker * ix->n_media + medium;
  ix->slot_seen[slot] = 1;
  for (size_t j = 0; j < n; j++) {
    parent ^= block_hash(ix, tokens + j * ix->block_size, pos0 + j);
    if ((ix->used + 1) * 10 > ix->cap * 7 && key_grow(ix)) return KVP_SKIP_NO_MEMORY;
    uint64_t *row = key_row(ix, key_find(ix, parent));
    if (!row[0]) {
      row[0] = parent | OCCUPIED;
      ix->used++;
    }
    row[1 + slot / 64] |= 1ULL << (slot % 64);
    if (name_put(names, ehashes[j], parent, pos0 + j)) return KVP_SKIP_NO_MEMORY;
  }
  return KVP_APPLIED;
}

static int held_by_worker(const kvp_index *ix, const uint64_t *row, uint32_t worker) {
  for (uint32_t m = 0; m < ix->n_media; m++) {
    uint32_t s = worker * ix->n_media + m;
    if (row[1 + s / 64] >> (s % 64) & 1) return 1;
  }
  return 0;
}

static int row_empty(const kvp_index *ix, const uint64_t *row) {
  for (uint32_t w = 0; w < ix->words; w++)
    if (row[1 + w]) return 0;
  return 1;
}

int kvp_index_remove(kvp_index *ix, uint32_t worker, uint32_t medium, const uint64_t *ehashes,
                     size_t n) {
  if (worker >= ix->max_workers || medium >= ix->n_media) return KVP_SKIP_UNKNOWN_SLOT;
  uint32_t slot = worker * ix->n_media + medium;
  if (!ix->slot_seen[slot]) return KVP_SKIP_UNKNOWN_SLOT;
  name_table *names = &ix->names[worker];
  for (size_t j = 0; j < n; j++) {
    name_entry *e = name_find(names, ehashes[j]);
    if (!e || !e->pos) continue;
    size_t at = key_find(ix, e->key);
    uint64_t *row = key_row(ix, at);
    uint64_t bit = 1ULL << (slot % 64);
    if (!row[0] || !(row[1 + slot / 64] & bit)) continue;
    row[1 + slot / 64] &= ~bit;
    int others = held_by_worker(ix, row, worker);
    if (row_empty(ix, row)) key_delete(ix, at);
    if (!others) name_delete(names, e);
  }
  return KVP_APPLIED;
}

void kvp_index_clear_worker(kvp_index *ix, uint32_t worker) {
  if (worker >= ix->max_workers) return;
  name_table *names = &ix->names[worker];
  for (size_t i = 0; i < names->cap; i++) {
    if (!names->slots[i].pos) continue;
    size_t at = key_find(ix, names->slots[i].key);
    uint64_t *row = key_row(ix, at);
    if (!row[0]) continue;
    for (uint32_t m = 0; m < ix->n_media; m++) {
      uint32_t s = worker * ix->n_media + m;
      row[1 + s / 64] &= ~(1ULL << (s % 64));
    }
    if (row_empty(ix, row)) key_delete(ix, at);
  }
  free(names->slots);
  memset(names, 0, sizeof *names);
}

/* ---- the match (block_index.py's _full) ---- */
size_t kvp_index_match(const kvp_index *ix, const uint32_t *tokens, size_t n_tokens,
                       uint32_t *depths) {
  uint32_t n_slots = ix->max_workers * ix->n_media, words = ix->words;
  size_t n_blocks = n_tokens / ix->block_size;
  memset(depths, 0, n_slots * sizeof *depths);
  uint64_t alive[KVP_MAX_SLOTS / 64];
  for (uint32_t w = 0; w < words; w++) alive[w] = ~0ULL;
  uint64_t key = 0;
  int any = n_blocks > 0;
  for (size_t j = 0; j < n_blocks && any; j++) {
    key ^= block_hash(ix, tokens + j * ix->block_size, j);
    const uint64_t *row = key_row(ix, key_find(ix, key));
    any = 0;
    for (uint32_t w = 0; w < words; w++) {
      uint64_t held = row[0] ? alive[w] & row[1 + w] : 0;
      for (uint64_t gone = alive[w] & ~held; gone && j; gone &= gone - 1)
        depths[w * 64 + (uint32_t)__builtin_ctzll(gone)] = (uint32_t)j;
      alive[w] = held;
      any |= held != 0;
    }
  }
  if (any)
    for (uint32_t w = 0; w < words; w++)
      for (uint64_t rest = alive[w]; rest; rest &= rest - 1)
        depths[w * 64 + (uint32_t)__builtin_ctzll(rest)] = (uint32_t)n_blocks;
  return n_blocks;
}
