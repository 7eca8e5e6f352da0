/* kvpilot's per-request decision in C: block naming, the block index, the prefix match,
 * Dynamo's cost, the active-block ledger and the sessions (routing/index/chain.py,
 * routing/index/block_index.py, routing/decide/cost.py, ledger.py, residency.py).
 *
 * Pure: no I/O, clock, thread or global state. No structure is thread-safe: callers serialize
 * writers against readers. Every function bounds-checks its inputs and reports a refusal as a
 * return code; none aborts on hostile input.
 *
 * Scope (what the Python router does that this does not): only the default namespace (no
 * LoRA, no cache_salt, no multimodal extra keys: such events are skipped, such prompts are not
 * decided here); co-located candidates only (no P->D pairs, no local-vs-remote policy, no
 * P/D session options); router_temperature 0 only; objective "blocks" only (no predicted TTFT).
 */
#ifndef KVP_CORE_H
#define KVP_CORE_H

#include <stddef.h>
#include <stdint.h>

#define KVP_API __attribute__((visibility("default")))

#define KVP_KEY_BITS 60
#define KVP_MAX_BLOCK_SIZE 4096
#define KVP_MAX_MEDIA 8
#define KVP_MAX_SLOTS 1024

/* Outcomes of kvp_index_store / kvp_index_remove (the Python index's skip names). */
enum kvp_outcome {
  KVP_APPLIED = 0,
  KVP_SKIP_BLOCK_SIZE = 1,    /* another block size */
  KVP_SKIP_UNKNOWN_PARENT = 2,/* a parent this worker never announced */
  KVP_SKIP_BAD_SHAPE = 3,     /* token count != blocks * block_size, or no blocks */
  KVP_SKIP_UNKNOWN_SLOT = 4,  /* a worker or medium out of range */
  KVP_SKIP_NO_MEMORY = 5,
};

/* Tier classes of routing/config.py's TierClass, best first. */
enum kvp_tier_class { KVP_GPU = 0, KVP_HOST = 1, KVP_DISK = 2, KVP_SHARED = 3, KVP_NONE = 4 };

typedef struct kvp_index kvp_index;

/* A new empty index for ``max_workers`` workers times ``n_media`` media (slots), naming
 * blocks of ``block_size`` tokens with ``lanes`` (``block_size`` odd uint64 multipliers) and
 * ``position_lane``: chain.py's ``_lanes(block_size)`` and ``_POSITION_LANE``. NULL when a
 * size is out of range or memory runs out. */
KVP_API kvp_index *kvp_index_new(uint32_t block_size, uint32_t max_workers, uint32_t n_media,
                         const uint64_t *lanes, uint64_t position_lane);
KVP_API void kvp_index_free(kvp_index *ix);

/* Keys of ``n_blocks`` full blocks of ``tokens``, the first at chain position ``first_pos``,
 * chained onto ``parent`` (chain.py's chain_keys). */
KVP_API void kvp_chain_keys(const kvp_index *ix, const uint32_t *tokens, size_t n_blocks,
                    uint64_t first_pos, uint64_t parent, uint64_t *out);

/* A BlockStored event: ``n`` engine hashes, ``tokens`` (n * block_size of them), the parent's
 * engine hash if ``has_parent``. Returns an enum kvp_outcome. */
KVP_API int kvp_index_store(kvp_index *ix, uint32_t worker, uint32_t medium, const uint64_t *ehashes,
                    size_t n, int has_parent, uint64_t parent_ehash, uint32_t event_block_size,
                    const uint32_t *tokens, size_t n_tokens);
/* A BlockRemoved event; unknown hashes are ignored. Returns an enum kvp_outcome. */
KVP_API int kvp_index_remove(kvp_index *ix, uint32_t worker, uint32_t medium, const uint64_t *ehashes,
                     size_t n);
/* AllBlocksCleared (or a restart): the worker keeps no block in any medium. */
KVP_API void kvp_index_clear_worker(kvp_index *ix, uint32_t worker);

/* Each slot's longest cached prefix of ``tokens`` from block 0, in blocks, written to
 * ``depths[worker * n_media + medium]`` (zero where none; the array holds max_workers *
 * n_media entries). Returns the prompt's full blocks. Does not modify the index. */
KVP_API size_t kvp_index_match(const kvp_index *ix, const uint32_t *tokens, size_t n_tokens,
                       uint32_t *depths);

/* The ``cost`` section (routing/config.py CostConfig), the fields the formula reads. */
typedef struct kvp_cost_config {
  double overlap_score_credit, overlap_score_credit_decay;
  double host_cache_hit_weight, disk_cache_hit_weight, shared_cache_multiplier;
  double prefill_load_scale, decode_active_request_weight;
  double session_affinity_credit, session_residency_weight;
  int session_stays_unless_sooner;
} kvp_cost_config;

/* One candidate's inputs besides its overlap: cost.py's CandidateTable row. */
typedef struct kvp_load {
  double prefill_blocks, decode_blocks, requests, shared_decode_blocks;
  double pair_penalty_blocks, resident_blocks;
  int session_affinity;
} kvp_load;

/* Fold one worker's per-medium depths into cost.py's TierOverlap (gpu, host, disk, shared),
 * each class counted beyond the better ones; ``classes`` maps a medium to its enum
 * kvp_tier_class; ``shared_depth`` is the fleet's deepest shared-tier prefix. */
KVP_API void kvp_tier_overlap(const uint32_t *depths, const uint8_t *classes, uint32_t n_media,
                      uint32_t shared_depth, double out[4]);

/* The cost of each of ``n`` candidates (cost.py's formula) into ``costs``, and the rows the
 * pick is made among (cost.py's ``eligible``) as the lowest-cost ones, written to ``ties``;
 * returns how many tie, 0 when n is 0. ``overlap`` is n rows of 4. */
KVP_API size_t kvp_price(const kvp_cost_config *cfg, uint64_t prompt_blocks, size_t n,
                 const double *overlap, const kvp_load *load, double *costs, uint32_t *ties);

/* Sessions (kvp_session.c): each session's last worker and the blocks of the sessions living
 * on each worker (routing/decide/residency.py), for ``capacity`` sessions (the least recently
 * settled is forgotten past it) of ``n_workers`` workers; a session lives on a worker until
 * ``horizon_s`` after it last settled there. Times are seconds on any one clock, never
 * decreasing across calls. Keys are the caller's 64-bit names of sessions. */
typedef struct kvp_sessions kvp_sessions;
KVP_API kvp_sessions *kvp_sessions_new(uint32_t capacity, uint32_t n_workers, double horizon_s);
KVP_API void kvp_sessions_free(kvp_sessions *s);
/* The worker that served ``key`` last (kvp_sessions_served), -1 when none. */
KVP_API int kvp_sessions_last(const kvp_sessions *s, uint64_t key);
/* Per worker (``n_workers`` entries), the blocks of the sessions living there at ``now``;
 * valid until the next call on ``s``. */
KVP_API const double *kvp_sessions_resident(kvp_sessions *s, double now);
/* ``key``'s step of ``blocks`` blocks was routed to ``worker`` at ``now``: it lives there. */
KVP_API void kvp_sessions_settle(kvp_sessions *s, uint64_t key, uint32_t worker, uint32_t blocks, double now);
/* ``key``'s step ended on ``worker`` at ``now``: it lives there and ``worker`` served it last. */
KVP_API void kvp_sessions_served(kvp_sessions *s, uint64_t key, uint32_t worker, uint32_t blocks, double now);
KVP_API uint32_t kvp_sessions_count(const kvp_sessions *s);

/* The active-block ledger (kvp_ledger.c, routing/decide/ledger.py's held blocks): per worker,
 * how many active requests name each block key. */
typedef struct kvp_ledger kvp_ledger;
KVP_API kvp_ledger *kvp_ledger_new(uint32_t n_workers);
KVP_API void kvp_ledger_free(kvp_ledger *l);
/* A request on ``worker`` naming ``keys`` became active. Returns an enum kvp_outcome. */
KVP_API int kvp_ledger_add(kvp_ledger *l, uint32_t worker, const uint64_t *keys, size_t n);
/* A request added with ``keys`` ended (a key never added is ignored). */
KVP_API void kvp_ledger_remove(kvp_ledger *l, uint32_t worker, const uint64_t *keys, size_t n);
/* ``worker``'s unique active blocks (Dynamo's decode blocks). */
KVP_API uint64_t kvp_ledger_unique(const kvp_ledger *l, uint32_t worker);
/* The leading blocks of the chain ``keys`` that active requests on ``worker`` name
 * (ledger.py's shared_decode_blocks; each key names its whole prefix). */
KVP_API size_t kvp_ledger_shared_depth(const kvp_ledger *l, uint32_t worker, const uint64_t *keys, size_t n);

#endif
