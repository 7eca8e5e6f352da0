/* CPU time of the compiled decision on a workload file (written by measure.py): the body's
 * parse, then the prompt's match, each worker's overlap and the price of every worker, as the
 * Envoy module runs them per request. Prints microseconds of process CPU per step.
 *
 *   bench_decision WORKLOAD ITERATIONS
 *
 * WORKLOAD (little-endian u32s): block_size, workers, n_prompt, prompt ids, body bytes and
 * the body, then per stored event: worker, n_tokens, tokens (a chain from block 0). */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "kvp_core.h"
#include "kvp_wire.h"

static double cpu_us(void) {
  struct timespec t;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return 1e6 * (double)t.tv_sec + 1e-3 * (double)t.tv_nsec;
}

static uint32_t *read_all(const char *path, size_t *n) {
  FILE *f = fopen(path, "rb");
  if (!f) return NULL;
  fseek(f, 0, SEEK_END);
  long size = ftell(f);
  fseek(f, 0, SEEK_SET);
  uint32_t *buf = malloc((size_t)size + 4);
  *n = buf ? fread(buf, 4, (size_t)size / 4, f) : 0;
  fclose(f);
  return buf;
}

int main(int argc, char **argv) {
  size_t n, at = 0;
  uint32_t *w = argc == 3 ? read_all(argv[1], &n) : NULL;
  if (!w) return fprintf(stderr, "usage: %s WORKLOAD ITERATIONS\n", argv[0]), 2;
  long iterations = atol(argv[2]);
  uint32_t block = w[at++], workers = w[at++], n_prompt = w[at++];
  const uint32_t *prompt = w + at;
  at += n_prompt;
  uint32_t body_len = w[at++];
  const char *body = (const char *)(w + at);
  at += (body_len + 3) / 4;
  uint64_t lanes[KVP_MAX_BLOCK_SIZE];
  for (uint32_t i = 0; i < block; i++) lanes[i] = (0x9E3779B97F4A7C15ULL * (i + 1)) | 1;
  kvp_index *ix = kvp_index_new(block, workers, 1, lanes, 0xBF58476D1CE4E5B9ULL);
  uint64_t hashes[4096];
  while (at + 2 <= n) {
    uint32_t worker = w[at++], n_tokens = w[at++];
    for (uint32_t j = 0; j < n_tokens / block; j++) hashes[j] = ((uint64_t)worker << 32) | j;
    kvp_index_store(ix, worker, 0, hashes, n_tokens / block, 0, 0, block, w + at, n_tokens);
    at += n_tokens;
  }
  uint32_t *ids = malloc((body_len / 2 + 1) * 4), *depths = malloc(workers * 4), *ties = malloc(workers * 4);
  double *overlap = malloc(workers * 32), *costs = malloc(workers * 8);
  kvp_load *loads = calloc(workers, sizeof *loads);
  kvp_cost_config cfg = {1.0, 0.0, 0.75, 0.25, 0.5, 1.0, 0.0, 16.0, 1.0, 1};
  uint8_t gpu = KVP_GPU;
  size_t n_ids = 0, checksum = 0;
  double t0 = cpu_us();
  for (long i = 0; i < iterations; i++) checksum += (size_t)kvp_parse_prompt(body, body_len, NULL, NULL, ids, body_len / 2 + 1, &n_ids);
  double t1 = cpu_us();
  for (long i = 0; i < iterations; i++) {
    size_t blocks = kvp_index_match(ix, prompt, n_prompt, depths);
    for (uint32_t k = 0; k < workers; k++) kvp_tier_overlap(depths + k, &gpu, 1, 0, overlap + 4 * k);
    checksum += kvp_price(&cfg, blocks, workers, overlap, loads, costs, ties) + ties[0];
  }
  double t2 = cpu_us();
  printf("{\"parse_us\": %.2f, \"decide_us\": %.2f, \"ids\": %zu, \"checksum\": %zu}\n",
         (t1 - t0) / (double)iterations, (t2 - t1) / (double)iterations, n_ids, checksum);
  kvp_index_free(ix);
  free(w), free(ids), free(depths), free(ties), free(overlap), free(costs), free(loads);
  return 0;
}
