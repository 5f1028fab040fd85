/* The dispatch plan's integer work on CPU, for hpctrain_moe.native (ctypes).
 *
 * For (n, k) expert ids in token-major order, optionally masked by keep
 * (the assignments within capacity), a counting sort by expert, stable:
 * one pass counts the kept assignments per expert (and checks the ids), one
 * places them. Same results as the torch path of dispatch._index_plan:
 *   counts[e]   kept assignments of expert e                   (E)
 *   offsets[t]  where token t's kept assignments start, in (token, choice)
 *               order; offsets[n] = A                             (n + 1)
 *   kept[j]     the (token, choice) slot of kept assignment j  (A; only with keep)
 *   order[p]    the kept assignment j sent p-th (grouped by expert) (A)
 *   token[p]    its token, slot / k                             (A)
 *   bag[j]      the combine's row of assignment j: the rows of experts
 *               [own_lo, own_hi) (this rank's own) first, then the others
 *               in send order                                  (A)
 * Returns A; -1 when an id is outside [0, E), -2 when there is no memory for the
 * expert cursors (nothing else is then valid).
 */
#include <stdint.h>
#include <stdlib.h>

int64_t hpctrain_moe_plan(const int64_t *experts, const uint8_t *keep, int64_t n, int64_t k, int64_t num_experts,
                          int64_t own_lo, int64_t own_hi, int64_t *counts, int64_t *offsets, int64_t *kept,
                          int64_t *order, int64_t *token, int64_t *bag) {
    int64_t rows = 0;
    for (int64_t e = 0; e < num_experts; e++) counts[e] = 0;
    for (int64_t t = 0; t < n; t++) {
        offsets[t] = rows;
        for (int64_t i = t * k; i < (t + 1) * k; i++) {
            if (keep && !keep[i]) continue;
            int64_t e = experts[i];
            if (e < 0 || e >= num_experts) return -1;
            counts[e]++;
            if (keep) kept[rows] = i;
            rows++;
        }
    }
    offsets[n] = rows;
    int64_t *next = malloc((size_t)(num_experts > 0 ? num_experts : 1) * sizeof(int64_t));
    if (!next) return -2;
    int64_t at = 0, own_first = 0, own_end = 0;
    for (int64_t e = 0; e < num_experts; e++) {
        if (e == own_lo) own_first = at;
        next[e] = at;
        at += counts[e];
        if (e + 1 == own_hi) own_end = at;
    }
    int64_t own = own_end - own_first;
    for (int64_t t = 0, i = 0, j = 0; t < n; t++) {
        for (int64_t c = 0; c < k; c++, i++) {
            if (keep && !keep[i]) continue;
            int64_t p = next[experts[i]]++;
            order[p] = j;
            token[p] = t;
            bag[j++] = p < own_first ? p + own : p < own_end ? p - own_first : p;
        }
    }
    free(next);
    return rows;
}
