/* Split-KV decoding on the CPU, float32: a few query rows over a long KV cache, read once.
 *
 * Built and loaded by qkv/kernels/_native.py (the machine's C compiler, at first use) and
 * called by qkv/kernels/_decode.py, whose docstring gives the semantics. Shape legend: B
 * batch rows, H key/value heads, R = G·Lq query rows per head (row r = g·Lq + i: the G
 * query heads of a group times the Lq tokens), D and Dv head dims.
 *
 * Row b's keys [starts[b], ends[b]) are cut at multiples of `partition` into segments; a
 * segment is one task. It reads its positions in chunks of CHUNK, each position's keys of
 * all H heads together (a contiguous run of memory), and keeps for every (head, query row)
 * the running maximum m, the sum of exponentials l and the unnormalised context acc (the
 * online softmax of the tiled kernel). `threads` threads share the tasks; each row's
 * segments are then merged by their log-sum-exps:
 *     M = max m_p,  out = Σ exp(m_p − M)·acc_p / Σ exp(m_p − M)·l_p,  lse = M + log Σ …
 * A causal query row sees keys j ≤ ends[b] − Lq + i, and with a window of `left` (≥ 0) keys
 * j ≥ ends[b] − Lq + i − left. Nothing outside a row's keys is read.
 * Every product is computed, with no test on the weight, so a NaN in a key or value that a
 * row reads reaches its output, as in the reference.
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define CHUNK 32       /* positions whose scores are computed before their values are read */
#define MAX_THREADS 256
#define W 8            /* floats in a vector of 32 bytes */

typedef float vec __attribute__((vector_size(32)));

typedef struct {
    const float *q;                /* (B, H, R, D), contiguous, already scaled */
    const float *k, *v;            /* element 0 of the cache (of its pages) */
    int64_t k_row, k_pos, k_head;  /* strides of k in elements: cache row, position, head */
    int64_t v_row, v_pos, v_head;
    const int64_t *rows;           /* (B) the cache row of batch row b, or NULL: row b */
    const int64_t *table;          /* (B, pages_per_row) page ids, or NULL: contiguous */
    int64_t pages_per_row, block, k_page, v_page; /* positions per page, page strides */
    const int64_t *starts, *ends;  /* (B) */
    int64_t batch, heads, rows_per_head, lq, dim, dim_v, causal, left, partition, threads;
    float *out;                    /* (B, H, R, Dv), written */
    float *lse;                    /* (B, H, R), written: natural log, −inf without keys */
} decode_args;

typedef struct { int64_t row, lo, hi; } segment;

typedef struct {
    const decode_args *a;
    const segment *segs;
    int64_t n_segs, next;  /* next: the next segment to take (atomic) */
    float *partial;        /* per segment: (H·R) m, (H·R) l, (H·R, Dv) acc */
    int failed;
} job;

static inline vec load(const float *p) {
    vec x;
    memcpy(&x, p, sizeof x);
    return x;
}

static inline void store(float *p, vec x) { memcpy(p, &x, sizeof x); }

typedef int32_t ivec __attribute__((vector_size(32)));

/* exp(x) for x ≤ 0 (or NaN), 8 at a time: 2^n · e^r with n = round(x / ln 2), |r| ≤ ln 2 / 2,
 * e^r by Cephes's polynomial (within 2 ulp of expf); 0 below −87.3 (where expf gives less
 * than 2^−126) and at −inf. NaN stays NaN. */
static inline vec exp_nonpositive(vec x) {
    const ivec tiny = x < -87.3f;
    const vec scaled = x * 1.44269504088896341f + 0.5f;
    vec n = __builtin_convertvector(__builtin_convertvector(scaled, ivec), vec);
    n -= (vec)((ivec)(n > scaled) & (ivec)((vec){0} + 1.0f)); /* floor */
    const vec r = x - n * 0.693359375f - n * -2.12194440e-4f;
    vec p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const ivec power = (__builtin_convertvector(n, ivec) + 127) << 23;
    return (vec)((ivec)(p * (vec)power) & ~tiny);
}

/* scores of ROWS query rows q + r·n against one key, into out[r·stride] */
#define DOTS(ROWS)                                                                          \
    static inline void dots##ROWS(const float *restrict q, const float *restrict key,       \
                                  int64_t n, float *restrict out, int64_t stride) {         \
        vec acc[ROWS][2] = {{{0}}};                                                         \
        int64_t d = 0;                                                                      \
        for (; d + 2 * W <= n; d += 2 * W) {                                                \
            const vec k0 = load(key + d), k1 = load(key + d + W);                           \
            for (int r = 0; r < ROWS; r++) {                                                \
                acc[r][0] += load(q + r * n + d) * k0;                                      \
                acc[r][1] += load(q + r * n + d + W) * k1;                                  \
            }                                                                               \
        }                                                                                   \
        for (int r = 0; r < ROWS; r++) {                                                    \
            const vec both = acc[r][0] + acc[r][1];                                         \
            float s = 0;                                                                    \
            for (int l = 0; l < W; l++) s += both[l];                                       \
            for (int64_t e = d; e < n; e++) s += q[r * n + e] * key[e];                     \
            out[r * stride] = s;                                                            \
        }                                                                                   \
    }
DOTS(4)
DOTS(1)

/* acc[r] += Σ_t p[r·CHUNK + t]·value_t for the R rows r and COUNT positions t: each vector
 * of acc is loaded and stored once per COUNT positions */
#define ACCUMULATE(COUNT)                                                                   \
    static inline void accumulate##COUNT(float *restrict acc, const float *restrict p,      \
                                         int64_t R, const float *const *value, int64_t n) { \
        int64_t d = 0;                                                                      \
        for (; d + W <= n; d += W) {                                                        \
            vec x[COUNT];                                                                   \
            for (int t = 0; t < COUNT; t++) x[t] = load(value[t] + d);                      \
            for (int64_t r = 0; r < R; r++) {                                               \
                vec sum = load(acc + r * n + d);                                            \
                for (int t = 0; t < COUNT; t++) sum += p[r * CHUNK + t] * x[t];             \
                store(acc + r * n + d, sum);                                                \
            }                                                                               \
        }                                                                                   \
        for (; d < n; d++)                                                                  \
            for (int64_t r = 0; r < R; r++)                                                 \
                for (int t = 0; t < COUNT; t++) acc[r * n + d] += p[r * CHUNK + t] * value[t][d]; \
    }
ACCUMULATE(4)
ACCUMULATE(1)

static void run_segment(const decode_args *a, const segment *sg, float *part, float *scores) {
    const int64_t H = a->heads, R = a->rows_per_head, D = a->dim, Dv = a->dim_v, HR = H * R;
    float *m = part, *l = part + HR, *acc = part + 2 * HR;
    const float *q = a->q + sg->row * HR * D;
    const int64_t cache_row = a->rows ? a->rows[sg->row] : sg->row;
    const int64_t *pages = a->table ? a->table + sg->row * a->pages_per_row : NULL;
    const int64_t end = a->ends[sg->row];
    for (int64_t x = 0; x < HR; x++) m[x] = -INFINITY, l[x] = 0;
    memset(acc, 0, sizeof(float) * HR * Dv);
    for (int64_t c0 = sg->lo; c0 < sg->hi; c0 += CHUNK) {
        const int64_t n = sg->hi - c0 < CHUNK ? sg->hi - c0 : CHUNK;
        const float *kp[CHUNK], *vp[CHUNK];
        for (int64_t t = 0; t < n; t++) {
            const int64_t j = c0 + t;
            if (pages) {
                const int64_t page = pages[j / a->block], at = j % a->block;
                kp[t] = a->k + page * a->k_page + at * a->k_pos;
                vp[t] = a->v + page * a->v_page + at * a->v_pos;
            } else {
                kp[t] = a->k + cache_row * a->k_row + j * a->k_pos;
                vp[t] = a->v + cache_row * a->v_row + j * a->v_pos;
            }
        }
        /* scores[x·CHUNK + t], x = h·R + r */
        for (int64_t t = 0; t < n; t++)
            for (int64_t h = 0; h < H; h++)
                for (int64_t r = 0; r < R;) { /* four query rows at a time, then one */
                    const float *row = q + (h * R + r) * D, *key = kp[t] + h * a->k_head;
                    float *into = scores + (h * R + r) * CHUNK + t;
                    if (R - r >= 4) dots4(row, key, D, into, CHUNK), r += 4;
                    else dots1(row, key, D, into, CHUNK), r += 1;
                }
        for (int64_t x = 0; x < HR; x++) /* up to whole vectors: weight 0 */
            for (int64_t t = n; t % W; t++) scores[x * CHUNK + t] = -INFINITY;
        if ((a->causal && c0 + n > end - a->lq + 1) || (a->left >= 0 && c0 < end - 1 - a->left))
            for (int64_t x = 0; x < HR; x++) { /* row x is query i = (x % R) % Lq */
                const int64_t at = end - a->lq + (x % R) % a->lq;
                for (int64_t t = 0; t < n; t++)
                    if ((a->causal && c0 + t > at) || (a->left >= 0 && c0 + t < at - a->left))
                        scores[x * CHUNK + t] = -INFINITY;
            }
        for (int64_t x = 0; x < HR; x++) {
            float *s = scores + x * CHUNK, top = m[x];
            for (int64_t t = 0; t < n; t++)
                if (s[t] > top || isnan(s[t])) top = isnan(top) ? top : s[t];
            if (top > m[x]) { /* a new maximum: rescale what came before */
                const float alpha = m[x] == -INFINITY ? 0.0f : expf(m[x] - top);
                l[x] *= alpha;
                for (int64_t d = 0; d < Dv; d++) acc[x * Dv + d] *= alpha;
            }
            m[x] = top;
            const float shift = top == -INFINITY ? 0.0f : top; /* no key yet: weights 0 */
            vec sum = {0};
            for (int64_t t = 0; t < n; t += W) { /* scores past n: −inf, weight 0 */
                vec e = exp_nonpositive(load(s + t) - shift);
                store(s + t, e);
                sum += e;
            }
            for (int lane = 0; lane < W; lane++) l[x] += sum[lane];
        }
        for (int64_t t = 0; t < n;) { /* four positions at a time, then one */
            const int count = n - t < 4 ? 1 : 4;
            for (int64_t h = 0; h < H; h++) {
                const float *value[4];
                for (int u = 0; u < count; u++) value[u] = vp[t + u] + h * a->v_head;
                float *into = acc + h * R * Dv;
                const float *p = scores + h * R * CHUNK + t;
                if (count == 4) accumulate4(into, p, R, value, Dv);
                else accumulate1(into, p, R, value, Dv);
            }
            t += count;
        }
    }
}

static void *worker(void *arg) {
    job *jb = (job *)arg;
    const decode_args *a = jb->a;
    const int64_t HR = a->heads * a->rows_per_head, stride = HR * (2 + a->dim_v);
    float *scores = (float *)malloc(sizeof(float) * HR * CHUNK);
    if (!scores) {
        __atomic_store_n(&jb->failed, 1, __ATOMIC_RELAXED);
        return NULL;
    }
    for (;;) {
        const int64_t t = __atomic_fetch_add(&jb->next, 1, __ATOMIC_RELAXED);
        if (t >= jb->n_segs) break;
        run_segment(a, jb->segs + t, jb->partial + t * stride, scores);
    }
    free(scores);
    return NULL;
}

static void merge(const decode_args *a, const segment *segs, int64_t n_segs,
                  const float *partial) {
    const int64_t HR = a->heads * a->rows_per_head, Dv = a->dim_v, stride = HR * (2 + Dv);
    int64_t first = 0;
    for (int64_t b = 0; b < a->batch; b++) {
        int64_t last = first;
        while (last < n_segs && segs[last].row == b) last++;
        for (int64_t x = 0; x < HR; x++) {
            float top = -INFINITY, total = 0;
            float *o = a->out + (b * HR + x) * Dv;
            for (int64_t t = first; t < last; t++) { /* parts without keys (l = 0) left out */
                const float mt = partial[t * stride + x], lt = partial[t * stride + HR + x];
                if (isnan(mt) || isnan(lt)) top = NAN;
                else if (lt > 0 && mt > top) top = mt;
            }
            memset(o, 0, sizeof(float) * Dv);
            for (int64_t t = first; t < last; t++) {
                const float *pt = partial + t * stride, lt = pt[HR + x];
                if (!(lt > 0) && !isnan(lt)) continue;
                const float share = expf(pt[x] - top);
                total += share * lt;
                for (int64_t d = 0; d < Dv; d++) o[d] += share * pt[2 * HR + x * Dv + d];
            }
            const int seen = total > 0 || isnan(total);
            if (seen)
                for (int64_t d = 0; d < Dv; d++) o[d] /= total;
            a->lse[b * HR + x] = seen ? top + logf(total) : -INFINITY;
        }
        first = last;
    }
}

/* 0 on success, 1 when a buffer could not be allocated (nothing is written then) */
int qkv_decode_f32(const decode_args *a) {
    int64_t n_segs = 0;
    for (int64_t b = 0; b < a->batch; b++)
        if (a->ends[b] > a->starts[b])
            n_segs += (a->ends[b] - 1) / a->partition - a->starts[b] / a->partition + 1;
    const int64_t HR = a->heads * a->rows_per_head, size = n_segs ? n_segs : 1;
    segment *segs = (segment *)malloc(sizeof(segment) * size);
    float *partial = (float *)malloc(sizeof(float) * HR * (2 + a->dim_v) * size);
    if (!segs || !partial) {
        free(segs);
        free(partial);
        return 1;
    }
    int64_t t = 0;
    for (int64_t b = 0; b < a->batch; b++) {
        if (a->ends[b] <= a->starts[b]) continue;
        for (int64_t lo = a->starts[b] / a->partition * a->partition; lo < a->ends[b];
             lo += a->partition, t++) {
            segs[t].row = b;
            segs[t].lo = lo > a->starts[b] ? lo : a->starts[b];
            segs[t].hi = lo + a->partition < a->ends[b] ? lo + a->partition : a->ends[b];
        }
    }
    job jb = {a, segs, n_segs, 0, partial, 0};
    int64_t helpers = (a->threads < n_segs ? a->threads : n_segs) - 1;
    if (helpers > MAX_THREADS) helpers = MAX_THREADS;
    pthread_t ids[MAX_THREADS];
    int64_t started = 0;
    while (started < helpers && pthread_create(&ids[started], NULL, worker, &jb) == 0)
        started++;
    worker(&jb);
    for (int64_t i = 0; i < started; i++) pthread_join(ids[i], NULL);
    if (!jb.failed) merge(a, segs, n_segs, partial);
    free(segs);
    free(partial);
    return jb.failed;
}
