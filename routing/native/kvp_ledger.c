/* The active blocks of each worker (routing/decide/ledger.py's held blocks): a count per
 * (worker, block key) of the active requests naming that block, so that a worker's decode
 * load is its *unique* active blocks and a prompt's shared decode blocks are its leading
 * blocks already active there. Open addressing, linear probing, backward-shift deletion; the
 * table doubles when half full. */
#include <stdlib.h>

#include "kvp_core.h"

typedef struct cell {
  uint64_t key;     /* the block key; 0 with count 0: empty */
  uint32_t worker;
  uint32_t count;   /* active requests on ``worker`` naming ``key``; 0: empty */
} cell;

struct kvp_ledger {
  cell *cells;
  size_t cap, used;
  uint32_t n_workers;
  uint64_t *unique; /* per worker */
};

static inline size_t home_of(const kvp_ledger *l, uint64_t key, uint32_t worker) {
  uint64_t h = (key ^ ((uint64_t)worker * 0xC2B2AE3D27D4EB4FULL)) * 0x9E3779B97F4A7C15ULL;
  return (size_t)(h ^ (h >> 29)) & (l->cap - 1);
}

static size_t find(const kvp_ledger *l, uint64_t key, uint32_t worker) {
  size_t i = home_of(l, key, worker);
  while (l->cells[i].count && !(l->cells[i].key == key && l->cells[i].worker == worker)) i = (i + 1) & (l->cap - 1);
  return i;
}

kvp_ledger *kvp_ledger_new(uint32_t n_workers) {
  if (!n_workers || n_workers > KVP_MAX_SLOTS) return NULL;
  kvp_ledger *l = calloc(1, sizeof *l);
  if (!l) return NULL;
  l->cap = 1024, l->n_workers = n_workers;
  l->cells = calloc(l->cap, sizeof *l->cells);
  l->unique = calloc(n_workers, sizeof *l->unique);
  if (!l->cells || !l->unique) {
    kvp_ledger_free(l);
    return NULL;
  }
  return l;
}

void kvp_ledger_free(kvp_ledger *l) {
  if (!l) return;
  free(l->cells), free(l->unique);
  free(l);
}

static int grow(kvp_ledger *l) {
  cell *old = l->cells;
  size_t old_cap = l->cap;
  cell *grown = calloc(old_cap * 2, sizeof *grown);
  if (!grown) return -1;
  l->cells = grown, l->cap = old_cap * 2;
  for (size_t i = 0; i < old_cap; i++)
    if (old[i].count) l->cells[find(l, old[i].key, old[i].worker)] = old[i];
  free(old);
  return 0;
}

int kvp_ledger_add(kvp_ledger *l, uint32_t worker, const uint64_t *keys, size_t n) {
  if (worker >= l->n_workers) return KVP_SKIP_UNKNOWN_SLOT;
  if ((l->used + n) * 2 > l->cap) {
    while ((l->used + n) * 2 > l->cap)
      if (grow(l)) return KVP_SKIP_NO_MEMORY;
  }
  for (size_t j = 0; j < n; j++) {
    cell *c = &l->cells[find(l, keys[j], worker)];
    if (!c->count++) {
      c->key = keys[j], c->worker = worker;
      l->used++, l->unique[worker]++;
    }
  }
  return KVP_APPLIED;
}

/* Empty cell ``i`` and shift the probe run after it back (no tombstones). */
static void delete_cell(kvp_ledger *l, size_t i) {
  size_t j = i;
  for (;;) {
    j = (j + 1) & (l->cap - 1);
    if (!l->cells[j].count) break;
    size_t want = home_of(l, l->cells[j].key, l->cells[j].worker);
    if (i <= j ? (want <= i || want > j) : (want <= i && want > j)) {
      l->cells[i] = l->cells[j];
      i = j;
    }
  }
  l->cells[i] = (cell){0, 0, 0};
}

void kvp_ledger_remove(kvp_ledger *l, uint32_t worker, const uint64_t *keys, size_t n) {
  if (worker >= l->n_workers) return;
  for (size_t j = 0; j < n; j++) {
    size_t i = find(l, keys[j], worker);
    if (!l->cells[i].count) continue; /* never added: nothing to release */
    if (!--l->cells[i].count) {
      delete_cell(l, i);
      l->used--, l->unique[worker]--;
    }
  }
}

uint64_t kvp_ledger_unique(const kvp_ledger *l, uint32_t worker) {
  return worker < l->n_workers ? l->unique[worker] : 0;
}

static int held(const kvp_ledger *l, uint32_t worker, uint64_t key) {
  return l->cells[find(l, key, worker)].count != 0;
}

size_t kvp_ledger_shared_depth(const kvp_ledger *l, uint32_t worker, const uint64_t *keys, size_t n) {
  if (worker >= l->n_workers || !n || !l->unique[worker] || !held(l, worker, keys[0])) return 0;
  /* a key names its whole prefix: membership falls once along the chain (ledger.py's
   * galloping search): the first ``low`` blocks are held */
  size_t low = 1, step = 1;
  while (low < n) {
    size_t probe_at = n < low + step ? n : low + step;
    if (!held(l, worker, keys[probe_at - 1])) {
      size_t lo = low, hi = probe_at - 1; /* first not held lies in [lo, hi] */
      while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (held(l, worker, keys[mid])) lo = mid + 1; else hi = mid;
      }
      return lo;
    }
    low = probe_at, step *= 2;
  }
  return n;
}
