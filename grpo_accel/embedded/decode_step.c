/* The element-wise work of a float32 decode step between its matrix products, one call per piece.
 *
 * A decode step of a small model on CPU alternates products that stream megabytes of weights through the cache
 * with a few dozen small torch ops per layer (norms, rotary embedding, cache write, attention, SiLU), each
 * dispatched from Python with its code and data evicted by the product before it: 40-120 us an op where the same
 * op took 4-12 us in a loop of its own. Here each stretch between two products is one C call on the caller's
 * thread (grpo_accel/embedded/native.py builds and calls it), computing what the torch ops compute, in float32,
 * to float32 rounding (sums in another order; exp by the polynomial below, within 2 ulp of expf).
 *
 * Layouts: hidden and its norm [rows, width]; qkv [rows, (heads + 2 kv_heads) * dim] (q, then k, then v, each
 * head's dim contiguous); cos, sin [rows, dim] (sin's first half negated, so that rotating is x * cos +
 * roll(x, dim / 2) * sin); keys, values [rows, kv_heads, capacity, dim]; mask [rows, >= length + 1] additive.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* e^x: x = n ln2 + r, |r| <= ln2 / 2, e^r by its Taylor polynomial to r^7 (relative error < 2e-8), times 2^n;
 * 0 below -87 (where expf's results are denormal or 0: a masked score), e^88 above 88. */
static inline float exp_f32(float x) {
    float low = x < -87.0f ? 0.0f : 1.0f;
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    float n = rintf(x * 1.44269504088896341f);
    float r = x - n * 0.693145751953125f - n * 1.428606765330187e-06f;
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale * low;
}

/* hidden += delta (when given); out = hidden / sqrt(mean(hidden^2) + eps) * weight, row by row. */
void add_rms_norm(float *hidden, const float *delta, const float *weight, float eps, float *out, int64_t rows,
                  int64_t width) {
    for (int64_t r = 0; r < rows; r++) {
        float *x = hidden + r * width, *y = out + r * width;
        if (delta != NULL) {
            const float *d = delta + r * width;
#pragma omp simd
            for (int64_t i = 0; i < width; i++) x[i] += d[i];
        }
        float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
        for (int64_t i = 0; i < width; i++) squares += x[i] * x[i];
        float inverse = 1.0f / sqrtf(squares / (float)width + eps);
#pragma omp simd
        for (int64_t i = 0; i < width; i++) y[i] = x[i] * inverse * weight[i];
    }
}

/* out = silu(gate) * up for gate_up [rows, 2 * width] (gate first). */
void silu_mul(const float *gate_up, float *out, int64_t rows, int64_t width) {
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate_up + r * 2 * width, *u = g + width;
        float *y = out + r * width;
#pragma omp simd
        for (int64_t i = 0; i < width; i++) y[i] = g[i] / (1.0f + exp_f32(-g[i])) * u[i];
    }
}

static void rotate(const float *x, const float *cos, const float *sin, float *out, int64_t dim) {
    int64_t half = dim / 2;
#pragma omp simd
    for (int64_t i = 0; i < dim; i++) out[i] = x[i] * cos[i] + x[i < half ? i + half : i - half] * sin[i];
}

/* One query per row: rotate its q and k, write k and v at position `length` of the cache, attend over positions
 * 0..length with the mask, out [rows, heads * dim]. Returns 0, or -1 when scratch memory ran out. */
int attention(const float *qkv, const float *cos, const float *sin, float *keys, float *values, const float *mask,
              int64_t mask_stride, float *out, int64_t rows, int64_t heads, int64_t kv_heads, int64_t dim,
              int64_t capacity, int64_t length, float scaling) {
    int64_t width = (heads + 2 * kv_heads) * dim, groups = heads / kv_heads, seen = length + 1;
    float *scores = malloc((size_t)(seen + dim) * sizeof(float));
    if (scores == NULL) return -1;
    float *query = scores + seen;
    for (int64_t r = 0; r < rows; r++) {
        const float *row = qkv + r * width, *c = cos + r * dim, *s = sin + r * dim;
        for (int64_t g = 0; g < kv_heads; g++) {
            int64_t at = ((r * kv_heads + g) * capacity + length) * dim;
            rotate(row + (heads + g) * dim, c, s, keys + at, dim);
            memcpy(values + at, row + (heads + kv_heads + g) * dim, (size_t)dim * sizeof(float));
        }
        for (int64_t h = 0; h < heads; h++) {
            const float *k = keys + (r * kv_heads + h / groups) * capacity * dim;
            const float *v = values + (r * kv_heads + h / groups) * capacity * dim;
            rotate(row + h * dim, c, s, query, dim);
            float top = -INFINITY;
            for (int64_t t = 0; t < seen; t++) {
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int64_t i = 0; i < dim; i++) dot += query[i] * k[t * dim + i];
                scores[t] = dot * scaling + mask[r * mask_stride + t];
                top = scores[t] > top ? scores[t] : top;
            }
            float total = 0.0f;
#pragma omp simd reduction(+ : total)
            for (int64_t t = 0; t < seen; t++) {
                scores[t] = exp_f32(scores[t] - top);
                total += scores[t];
            }
            float *y = out + r * heads * dim + h * dim;
            memset(y, 0, (size_t)dim * sizeof(float));
            for (int64_t t = 0; t < seen; t++) {
                float p = scores[t] / total;
#pragma omp simd
                for (int64_t i = 0; i < dim; i++) y[i] += p * v[t * dim + i];
            }
        }
    }
    free(scores);
    return 0;
}
