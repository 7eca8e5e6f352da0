/* Dynamo's cost per candidate and the pick among the cheapest (routing/decide/cost.py:
 * _term_columns, eligible and CostModel.decide at router_temperature 0). The arithmetic is
 * cost.py's, term by term and in its order, so both give the same doubles. */
#include "kvp_core.h"

void kvp_tier_overlap(const uint32_t *depths, const uint8_t *classes, uint32_t n_media,
                      uint32_t shared_depth, double out[4]) {
  uint32_t best[4] = {0, 0, 0, 0};
  for (uint32_t m = 0; m < n_media; m++)
    if (classes[m] < KVP_NONE && depths[m] > best[classes[m]]) best[classes[m]] = depths[m];
  if (shared_depth > best[KVP_SHARED]) best[KVP_SHARED] = shared_depth;
  uint32_t covered = 0;
  for (int k = 0; k < 4; k++) {
    out[k] = best[k] > covered ? (double)(best[k] - covered) : 0.0;
    if (best[k] > covered) covered = best[k];
  }
}

static double adjusted_prefill(const kvp_cost_config *c, double prompt, const double *ov,
                               const kvp_load *l) {
  double gpu_credit = c->overlap_score_credit / (1.0 + c->overlap_score_credit_decay * l->prefill_blocks);
  double credit = gpu_credit * ov[0] + c->host_cache_hit_weight * ov[1] +
                  c->disk_cache_hit_weight * ov[2] + c->shared_cache_multiplier * ov[3];
  double adjusted = l->prefill_blocks + prompt - credit;
  return adjusted > 0.0 ? adjusted : 0.0;
}

size_t kvp_price(const kvp_cost_config *c, uint64_t prompt_blocks, size_t n,
                 const double *overlap, const kvp_load *load, double *costs, uint32_t *ties) {
  double prompt = (double)prompt_blocks;
  int any_home = 0;
  double home_start = 0.0;
  for (size_t i = 0; i < n; i++) {
    const kvp_load *l = &load[i];
    double adjusted = adjusted_prefill(c, prompt, overlap + 4 * i, l);
    double decode = l->decode_blocks + prompt - l->shared_decode_blocks;
    double request_cost = c->decode_active_request_weight * l->requests;
    double affinity = l->session_affinity ? c->session_affinity_credit : 0.0;
    double residency = c->session_residency_weight * l->resident_blocks;
    costs[i] = c->prefill_load_scale * adjusted + decode + request_cost + residency - affinity +
               l->pair_penalty_blocks;
    double start = c->prefill_load_scale * adjusted;
    if (l->session_affinity && (!any_home || start < home_start)) home_start = start;
    any_home |= l->session_affinity;
  }
  /* eligible(): a session's home rows, unless other rows would start the step sooner */
  int restrict_rows = c->session_stays_unless_sooner && any_home;
  int sooner_exists = 0;
  if (restrict_rows)
    for (size_t i = 0; i < n; i++)
      if (c->prefill_load_scale * adjusted_prefill(c, prompt, overlap + 4 * i, &load[i]) < home_start)
        sooner_exists = 1;
  size_t count = 0;
  double best = 0.0;
  for (size_t i = 0; i < n; i++) {
    if (restrict_rows) {
      double start = c->prefill_load_scale * adjusted_prefill(c, prompt, overlap + 4 * i, &load[i]);
      int allowed = sooner_exists ? start < home_start : load[i].session_affinity;
      if (!allowed) continue;
    }
    if (!count || costs[i] < best) {
      best = costs[i];
      count = 0;
    }
    if (costs[i] == best) ties[count++] = (uint32_t)i;
  }
  return count;
}
