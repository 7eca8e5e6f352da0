/* Fuzz harness for the compiled picker's hostile inputs: request bodies (kvp_parse_prompt),
 * KV-event batches (kvp_decode_batch, each event applied to a small index and the prompt
 * matched and priced) and engines' answers (kvp_scrub_answer, whose output scrubs to itself;
 * kvp_stream_feed, whose output is the same however the stream is cut). One entry point, LLVMFuzzerTestOneInput, serves libFuzzer (clang
 * -fsanitize=fuzzer) and the driver below (gcc with ASan and UBSan): the driver mutates the
 * seed files for a bounded time and aborts on the first fault the sanitizers report.
 *
 *   fuzz_wire body|events|answers SECONDS SEED...
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvp_answer.h"
#include "kvp_core.h"
#include "kvp_wire.h"

#define BLOCK 4
#define WORKERS 3
#define MEDIA 2

static int target_events, target_answers;

/* The stream's output for data cut at ``cuts`` (ascending offsets), concatenated. */
static size_t streamed(const uint8_t *data, size_t size, const size_t *cuts, int n_cuts, char *out) {
  kvp_stream st = {0};
  size_t total = 0, from = 0;
  for (int c = 0; c <= n_cuts; c++) {
    size_t to = c < n_cuts ? cuts[c] : size, len = 0;
    char *piece = malloc(to - from ? to - from : 1), *scrubbed = NULL; /* exact size: ASan sees an over-read */
    memcpy(piece, data + from, to - from);
    int rc = kvp_stream_feed(&st, piece, to - from, &scrubbed, &len);
    if (rc == KVP_SCRUB_UNCHANGED) memcpy(out + total, piece, to - from), total += to - from;
    else if (rc == KVP_SCRUB_CHANGED) memcpy(out + total, scrubbed, len), total += len;
    else abort();
    free(piece), free(scrubbed);
    from = to;
  }
  kvp_stream_clear(&st);
  return total;
}

static void answers(const uint8_t *data, size_t size) {
  char *out = NULL, *again = NULL;
  size_t len = 0, again_len = 0;
  int rc = kvp_scrub_answer((const char *)data, size, &out, &len);
  if (rc == KVP_SCRUB_CHANGED) { /* scrubbed once is scrubbed: unchanged, or the same bytes again */
    int rc2 = kvp_scrub_answer(out, len, &again, &again_len);
    if (rc2 == KVP_SCRUB_CHANGED ? again_len != len || memcmp(again, out, len) : rc2 != KVP_SCRUB_UNCHANGED) abort();
  }
  free(out), free(again);
  /* a stream's output grows by at most one withheld event a line */
  size_t cap = size * (strlen(kvp_withheld_chunk) + 8) + 64, cuts[3] = {size / 3, size / 2, size - size / 4};
  char *whole = malloc(cap), *cut = malloc(cap);
  size_t a = streamed(data, size, cuts, 0, whole), b = streamed(data, size, cuts, size ? 3 : 0, cut);
  if (a != b || memcmp(whole, cut, a)) abort();
  free(whole), free(cut);
}
static kvp_index *ix;

static void apply(void *ctx, const kvp_event *ev) {
  uint32_t worker = (uint32_t)(uintptr_t)ctx % WORKERS, medium = ev->medium_len % MEDIA;
  if (ev->kind == KVP_EV_CLEARED) kvp_index_clear_worker(ix, worker);
  else if (ev->kind == KVP_EV_STORED)
    kvp_index_store(ix, worker, medium, ev->ehashes, ev->n_hashes, ev->has_parent, ev->parent, ev->block_size,
                    ev->tokens, ev->n_tokens);
  else kvp_index_remove(ix, worker, medium, ev->ehashes, ev->n_hashes);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  static uint32_t ids[4096];
  static uint64_t hashes[512];
  static uint32_t tokens[2048];
  if (!ix) {
    uint64_t lanes[BLOCK] = {3, 5, 7, 9};
    ix = kvp_index_new(BLOCK, WORKERS, MEDIA, lanes, 11);
  }
  if (target_answers) return answers(data, size), 0;
  if (!target_events) {
    size_t n = 0;
    int status = kvp_parse_prompt((const char *)data, size, size % 2 ? "tiny" : NULL, size % 3 ? "prompt\nmodel" : NULL,
                                  ids, sizeof ids / sizeof *ids, &n);
    if (status != KVP_BODY_OK && n > sizeof ids / sizeof *ids) abort();
    return 0;
  }
  kvp_scratch scratch = {hashes, 512, tokens, 2048};
  kvp_batch_counts counts = {0, 0, 0, 0};
  kvp_decode_batch(data, size, &scratch, apply, (void *)(uintptr_t)size, &counts);
  uint32_t depths[WORKERS * MEDIA], prompt[64];
  for (uint32_t i = 0; i < 64; i++) prompt[i] = i < size ? data[i] : i;
  size_t blocks = kvp_index_match(ix, prompt, 64, depths);
  double overlap[WORKERS * 4], costs[WORKERS];
  uint8_t classes[MEDIA] = {KVP_GPU, KVP_HOST};
  kvp_load loads[WORKERS] = {{0}};
  uint32_t ties[WORKERS];
  for (int w = 0; w < WORKERS; w++) kvp_tier_overlap(depths + w * MEDIA, classes, MEDIA, 0, overlap + 4 * w);
  kvp_cost_config cfg = {1.0, 0.0, 0.75, 0.25, 0.5, 1.0, 0.0, 16.0, 1.0, 1};
  if (!kvp_price(&cfg, blocks, WORKERS, overlap, loads, costs, ties)) abort();
  return 0;
}

#ifndef KVP_LIBFUZZER
static uint64_t rng = 0x9E3779B97F4A7C15ULL;
static uint64_t next(void) {
  rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
  return rng;
}

static size_t mutate(uint8_t *buf, size_t len, size_t cap, const uint8_t *other, size_t other_len) {
  static const uint8_t interesting[] = {0x00, 0x7f, 0x80, 0xc0, 0xc1, 0xcc, 0xcf, 0xd3, 0xd9, 0xdb, 0xdc,
                                        0xdd, 0xde, 0xdf, 0xff, '"', '[', ']', '{', '}', ',', ':', '\\', '-'};
  for (int k = 1 + (int)(next() % 6); k > 0; k--) {
    size_t at = len ? next() % len : 0;
    switch (next() % 6) {
      case 0: if (len) buf[at] ^= (uint8_t)(1u << (next() % 8)); break;
      case 1: if (len) buf[at] = interesting[next() % sizeof interesting]; break;
      case 2: if (len < cap) { memmove(buf + at + 1, buf + at, len - at); buf[at] = (uint8_t)next(); len++; } break;
      case 3: if (len) { size_t n = 1 + next() % (len - at); memmove(buf + at, buf + at + n, len - at - n); len -= n; } break;
      case 4: if (len) len = at; break;
      default: if (other_len) { size_t from = next() % other_len, n = next() % (other_len - from + 1);
                 if (at + n > cap) n = cap - at; memcpy(buf + at, other + from, n); if (at + n > len) len = at + n; }
    }
  }
  return len;
}

int main(int argc, char **argv) {
  if (argc < 4) return fprintf(stderr, "usage: %s body|events|answers SECONDS SEED...\n", argv[0]), 2;
  target_events = !strcmp(argv[1], "events"), target_answers = !strcmp(argv[1], "answers");
  double seconds = atof(argv[2]);
  size_t n_seeds = (size_t)argc - 3, cap = 1 << 20;
  uint8_t **seeds = calloc(n_seeds, sizeof *seeds), *buf = malloc(cap);
  size_t *lens = calloc(n_seeds, sizeof *lens);
  for (size_t i = 0; i < n_seeds; i++) {
    FILE *f = fopen(argv[3 + i], "rb");
    if (!f) return perror(argv[3 + i]), 2;
    seeds[i] = malloc(cap);
    lens[i] = fread(seeds[i], 1, cap, f);
    fclose(f);
    LLVMFuzzerTestOneInput(seeds[i], lens[i]);
  }
  struct timespec start, now;
  clock_gettime(CLOCK_MONOTONIC, &start);
  unsigned long runs = 0;
  do {
    for (int batch = 0; batch < 256; batch++, runs++) {
      size_t s = next() % n_seeds, o = next() % n_seeds;
      memcpy(buf, seeds[s], lens[s]);
      size_t len = mutate(buf, lens[s], cap, seeds[o], lens[o]);
      uint8_t *exact = malloc(len ? len : 1); /* an exact-size copy: ASan sees any over-read */
      memcpy(exact, buf, len);
      LLVMFuzzerTestOneInput(exact, len);
      free(exact);
    }
    clock_gettime(CLOCK_MONOTONIC, &now);
  } while ((double)(now.tv_sec - start.tv_sec) + 1e-9 * (double)(now.tv_nsec - start.tv_nsec) < seconds);
  printf("%s: %lu inputs in %.0f s, no fault\n", argv[1], runs, seconds);
  for (size_t i = 0; i < n_seeds; i++) free(seeds[i]);
  free(seeds), free(lens), free(buf);
  kvp_index_free(ix);
  return 0;
}
#endif
