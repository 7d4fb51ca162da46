/* The soft-capped block's elementwise passes in one loop each (cpref.kernels.softcap_native).
 *
 * Every function works on float32 rows of `cols` scores, row-major, one OpenMP thread per run of
 * rows; each row is summed by one thread in the order the compiled loop fixes, so the results do
 * not depend on the thread count (deterministic).
 * tanhf and exp2f are glibc's vector variants (libmvec, glibc >= 2.35), declared SIMD here so
 * that the compiler calls them eight lanes at a time without -ffast-math: masked scores are
 * -inf and must stay IEEE (exp2(-inf) = 0, max ignores -inf).
 */
#include <math.h>

float tanhf(float) __attribute__((simd("notinbranch")));
float exp2f(float) __attribute__((simd("notinbranch")));

#define RUN 16384 /* elements a thread takes at a time in cap_tanh */

/* t = tanh(s), in place over n scores; with slope != 0 also slope = 1 - t^2 */
void cap_tanh(float *restrict s, float *restrict slope, long n, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long c0 = 0; c0 < n; c0 += RUN) {
        long c1 = c0 + RUN < n ? c0 + RUN : n;
        if (slope) {
#pragma omp simd
            for (long i = c0; i < c1; i++) {
                float t = tanhf(s[i]);
                s[i] = t;
                slope[i] = 1.0f - t * t;
            }
        } else {
#pragma omp simd
            for (long i = c0; i < c1; i++) s[i] = tanhf(s[i]);
        }
    }
}

// --8<-- [start:softmax]
/* per row: m = b max_y t_y; t_y <- 2^(b t_y - m); l = sum_y of those */
void cap_softmax(float *restrict s, long rows, long cols, float b, float *restrict m, float *restrict l, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long r = 0; r < rows; r++) {
        float *x = s + r * cols, top = -INFINITY, sum = 0.0f;
#pragma omp simd reduction(max : top)
        for (long i = 0; i < cols; i++) top = x[i] > top ? x[i] : top;
        top *= b;
#pragma omp simd reduction(+ : sum)
        for (long i = 0; i < cols; i++) {
            float p = exp2f(b * x[i] - top);
            x[i] = p;
            sum += p;
        }
        m[r] = top;
        l[r] = sum;
    }
}
// --8<-- [end:softmax]

/* per row: t_y <- 2^(b t_y - lse2) */
void cap_probs(float *restrict s, long rows, long cols, float b, const float *restrict lse2, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long r = 0; r < rows; r++) {
        float *x = s + r * cols, z = lse2[r];
#pragma omp simd
        for (long i = 0; i < cols; i++) x[i] = exp2f(b * x[i] - z);
    }
}

/* per row: dP <- P o (dP - Delta) o slope; Delta = rowsum(P o dP) where delta is 0, else delta[r] */
void cap_ds(float *restrict dp, const float *restrict p, const float *restrict slope, const float *restrict delta,
            long rows, long cols, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long r = 0; r < rows; r++) {
        float *d = dp + r * cols, z = 0.0f;
        const float *pr = p + r * cols, *sr = slope + r * cols;
        if (delta) {
            z = delta[r];
        } else {
#pragma omp simd reduction(+ : z)
            for (long i = 0; i < cols; i++) z += pr[i] * d[i];
        }
#pragma omp simd
        for (long i = 0; i < cols; i++) d[i] = (d[i] - z) * pr[i] * sr[i];
    }
}
