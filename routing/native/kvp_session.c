/* Sessions for the compiled picker: each session's last worker (routing/decide/sessions.py's
 * SessionState.last_worker) and the blocks of the sessions living on each worker
 * (routing/decide/residency.py's Residency), in one table of fixed capacity.
 *
 * Entries sit in an open-addressed table (linear probing, backward-shift deletion) and on one
 * list ordered by when they last settled, oldest first. A session living on a worker counts
 * its blocks there until ``horizon_s`` after it settled (Residency.blocks drops the oldest
 * first, as here); it keeps its last worker until the table is full and it is the oldest
 * (SessionStore's least recently used). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kvp_core.h"

#define EMPTY UINT32_MAX

typedef struct entry {
  uint64_t key;
  int32_t last;      /* last worker that served it, -1: none */
  int32_t home;      /* worker it lives on, -1: none (never settled, or expired) */
  uint32_t blocks;   /* its blocks on ``home`` */
  double settled;    /* when it last settled */
  uint32_t prev, next; /* the settle-ordered list (slot indices), EMPTY at the ends */
} entry;

struct kvp_sessions {
  uint32_t capacity, mask, n_workers, count;
  double horizon_s;
  uint32_t head, tail;   /* oldest and newest settled */
  uint32_t living;       /* oldest entry that may still live somewhere (EMPTY: none) */
  uint32_t *slots;       /* hash slot -> entry index, EMPTY when free */
  entry *entries;        /* entry pool, ``capacity`` of them */
  uint32_t *free_list, n_free;
  double *resident;      /* per worker: the living sessions' blocks */
};

kvp_sessions *kvp_sessions_new(uint32_t capacity, uint32_t n_workers, double horizon_s) {
  if (!capacity || capacity > (1u << 24) || !n_workers || !(horizon_s > 0) || !isfinite(horizon_s)) return NULL;
  uint32_t table = 2;
  while (table < capacity * 2u) table <<= 1;
  kvp_sessions *s = calloc(1, sizeof *s);
  if (!s) return NULL;
  s->capacity = capacity, s->mask = table - 1, s->n_workers = n_workers, s->horizon_s = horizon_s;
  s->head = s->tail = s->living = EMPTY;
  s->slots = malloc(table * sizeof *s->slots);
  s->entries = calloc(capacity, sizeof *s->entries);
  s->free_list = malloc(capacity * sizeof *s->free_list);
  s->resident = calloc(n_workers, sizeof *s->resident);
  if (!s->slots || !s->entries || !s->free_list || !s->resident) {
    kvp_sessions_free(s);
    return NULL;
  }
  memset(s->slots, 0xff, table * sizeof *s->slots);
  for (uint32_t i = 0; i < capacity; i++) s->free_list[i] = capacity - 1 - i;
  s->n_free = capacity;
  return s;
}

void kvp_sessions_free(kvp_sessions *s) {
  if (!s) return;
  free(s->slots), free(s->entries), free(s->free_list), free(s->resident);
  free(s);
}

static uint32_t slot_of(const kvp_sessions *s, uint64_t key) {
  uint64_t h = key * 0x9E3779B97F4A7C15ULL;
  return (uint32_t)(h >> 32) & s->mask;
}

/* The hash slot holding ``key``, or the free slot where it would go. */
static uint32_t probe(const kvp_sessions *s, uint64_t key) {
  uint32_t i = slot_of(s, key);
  while (s->slots[i] != EMPTY && s->entries[s->slots[i]].key != key) i = (i + 1) & s->mask;
  return i;
}

static void unlink_entry(kvp_sessions *s, uint32_t e) {
  entry *x = &s->entries[e];
  if (s->living == e) s->living = x->next;
  if (x->prev != EMPTY) s->entries[x->prev].next = x->next; else s->head = x->next;
  if (x->next != EMPTY) s->entries[x->next].prev = x->prev; else s->tail = x->prev;
  x->prev = x->next = EMPTY;
}

static void append(kvp_sessions *s, uint32_t e) {
  entry *x = &s->entries[e];
  x->prev = s->tail, x->next = EMPTY;
  if (s->tail != EMPTY) s->entries[s->tail].next = e; else s->head = e;
  s->tail = e;
  if (s->living == EMPTY) s->living = e;
}

static void leave(kvp_sessions *s, entry *x) {
  if (x->home >= 0) {
    s->resident[x->home] -= x->blocks;
    if (s->resident[x->home] < 0.5) s->resident[x->home] = 0.0; /* whole blocks: no drift */
    x->home = -1;
  }
}

/* Drop the hash slot ``i`` and shift the probe run after it back (no tombstones). */
static void delete_slot(kvp_sessions *s, uint32_t i) {
  uint32_t j = i;
  for (;;) {
    j = (j + 1) & s->mask;
    if (s->slots[j] == EMPTY) break;
    uint32_t want = slot_of(s, s->entries[s->slots[j]].key);
    /* move j's entry into i unless its wanted slot lies cyclically in (i, j] */
    if (i <= j ? (want <= i || want > j) : (want <= i && want > j)) {
      s->slots[i] = s->slots[j];
      i = j;
    }
  }
  s->slots[i] = EMPTY;
}

static void evict_oldest(kvp_sessions *s) {
  uint32_t e = s->head;
  entry *x = &s->entries[e];
  leave(s, x);
  delete_slot(s, probe(s, x->key));
  unlink_entry(s, e);
  s->free_list[s->n_free++] = e;
  s->count--;
}

int kvp_sessions_last(const kvp_sessions *s, uint64_t key) {
  uint32_t i = probe(s, key);
  return s->slots[i] == EMPTY ? -1 : s->entries[s->slots[i]].last;
}

const double *kvp_sessions_resident(kvp_sessions *s, double now) {
  while (s->living != EMPTY && now - s->entries[s->living].settled > s->horizon_s) {
    entry *x = &s->entries[s->living];
    leave(s, x);
    s->living = x->next;
  }
  return s->resident;
}

static entry *settle(kvp_sessions *s, uint64_t key, uint32_t worker, uint32_t blocks, double now) {
  if (worker >= s->n_workers) return NULL;
  uint32_t i = probe(s, key), e = s->slots[i];
  if (e == EMPTY) {
    if (!s->n_free) {
      evict_oldest(s);
      i = probe(s, key);
    }
    e = s->free_list[--s->n_free];
    s->slots[i] = e;
    s->entries[e] = (entry){key, -1, -1, 0, now, EMPTY, EMPTY};
    s->count++;
  } else {
    unlink_entry(s, e);
  }
  entry *x = &s->entries[e];
  leave(s, x);
  x->home = (int32_t)worker, x->blocks = blocks, x->settled = now;
  s->resident[worker] += blocks;
  append(s, e);
  return x;
}

void kvp_sessions_settle(kvp_sessions *s, uint64_t key, uint32_t worker, uint32_t blocks, double now) {
  settle(s, key, worker, blocks, now);
}

void kvp_sessions_served(kvp_sessions *s, uint64_t key, uint32_t worker, uint32_t blocks, double now) {
  entry *x = settle(s, key, worker, blocks, now);
  if (x) x->last = (int32_t)worker;
}

uint32_t kvp_sessions_count(const kvp_sessions *s) { return s->count; }
