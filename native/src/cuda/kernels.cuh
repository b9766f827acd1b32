// The CUDA kernels of libktd_cuda.so, shared by the test entry points (ktd_cuda.cu, ops.cu: host
// pointers, copies included) and the device backend's ABI (device.cu: device pointers, the
// context's stream). Their arithmetic is cuda/block_math.h and cuda/ops_math.h, which the CPU
// build compiles and tests. Included by .cu files only; everything is internal to each.
#pragma once
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/block_math.h"
#include "cuda/ktd_cuda.h"
#include "cuda/ops_math.h"

namespace {

using namespace ktd;
using namespace ktd::bm;
using namespace ktd::om;

// One thread per 32 activations: x [n][k] → act [n][k/32].
__global__ void quantize_act_kernel(const float *x, ActQ8 *act, int64_t n_sub) {
    const int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    if (t < n_sub) quantize_act(x + 32 * t, act[t]);
}

// Activation rows per warp in the block-type GEMV: each sub-block of weights is unpacked once and
// dotted with this many rows (prefill chunks), instead of once per row.
constexpr int kTokTile = 4;

// One warp per (output row, tile of kTokTile activation rows) of matrix m = blockIdx.y, at w +
// m·w_stride bytes, its activations act [m][n][k/32], its output row i at y + m·y_mat + i·y_pitch
// (the plain GEMV: one matrix, y [n][rows]; ktd_cuda_gemv_batched: a stack). The lanes stride over
// the row's sub-blocks of 32, then a shuffle reduction per activation row: each output sums in
// the same order whatever the tile.
template <class Block>
__global__ void gemv_q_batched_kernel(const void *w, uint64_t w_stride, int64_t rows, int64_t k, const ActQ8 *act,
                                      int64_t n, float *y, int64_t y_mat, int64_t y_pitch) {
    const int64_t m = blockIdx.y;
    const int64_t warp = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
    const int lane = threadIdx.x % 32;
    const int64_t n_tiles = (n + kTokTile - 1) / kTokTile;
    if (warp >= rows * n_tiles) return;
    const int64_t r = warp % rows, i0 = warp / rows * kTokTile;
    const int nt = int(n - i0 < kTokTile ? n - i0 : kTokTile);
    const int64_t n_sub = k / 32;
    const Block *row = reinterpret_cast<const Block *>(static_cast<const char *>(w) + uint64_t(m) * w_stride) +
                       r * (n_sub / SubsPerBlock<Block>::value);
    const ActQ8 *a = act + (m * n + i0) * n_sub;
    float acc[kTokTile] = {};
    for (int64_t t = lane; t < n_sub; t += 32) {
        Sub32 s;
        unpack_row_sub(row, t, s);
#pragma unroll
        for (int j = 0; j < kTokTile; ++j)
            if (j < nt) acc[j] += dot(s, a[j * n_sub + t]);
    }
#pragma unroll
    for (int j = 0; j < kTokTile; ++j) {
        float v = acc[j];
        for (int off = 16; off > 0; off /= 2) v += __shfl_down_sync(0xffffffffu, v, off);
        if (lane == 0 && j < nt) y[m * y_mat + (i0 + j) * y_pitch + r] = v;
    }
}

// The batched form's activations: x_m row i at x + m·x_mat + i·x_pitch → act [m][i][k/32], one
// thread per 32 (n_mat·n·k/32 threads).
__global__ void quantize_act_batched_kernel(const float *x, int64_t x_mat, int64_t x_pitch, int64_t k, int64_t n,
                                            int64_t n_mat, ActQ8 *act) {
    const int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    const int64_t n_sub = k / 32;
    if (t >= n_mat * n * n_sub) return;
    const int64_t sub = t % n_sub, i = (t / n_sub) % n, m = t / (n_sub * n);
    quantize_act(x + m * x_mat + i * x_pitch + 32 * sub, act[t]);
}

// F32/F16/BF16 weights against float activations, one warp per (row, activation row).
template <int Type>
__device__ __forceinline__ float load_weight(const void *w, int64_t idx) {
    if constexpr (Type == 0) return static_cast<const float *>(w)[idx];
    else if constexpr (Type == 1) return half_to_float(static_cast<const uint16_t *>(w)[idx]);
    else return bf16_to_float(static_cast<const uint16_t *>(w)[idx]);
}

template <int Type>
__device__ __forceinline__ float warp_dot_f(const void *w, int64_t w0, const float *x, int64_t k, int lane) {
    float acc = 0.0f;
    for (int64_t j = lane; j < k; j += 32) acc += load_weight<Type>(w, w0 + j) * x[j];
    for (int off = 16; off > 0; off /= 2) acc += __shfl_down_sync(0xffffffffu, acc, off);
    return acc;
}

// The same on float weights against float activations (row i of x_m at x + m·x_mat + i·x_pitch).
template <int Type>
__global__ void gemv_f_batched_kernel(const void *w, uint64_t w_stride, int64_t rows, int64_t k, const float *x,
                                      int64_t x_mat, int64_t x_pitch, int64_t n, float *y, int64_t y_mat,
                                      int64_t y_pitch) {
    const int64_t m = blockIdx.y;
    const int64_t warp = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
    const int lane = threadIdx.x % 32;
    if (warp >= rows * n) return;
    const int64_t r = warp % rows, i = warp / rows;
    const float acc = warp_dot_f<Type>(static_cast<const char *>(w) + uint64_t(m) * w_stride, r * k,
                                       x + m * x_mat + i * x_pitch, k, lane);
    if (lane == 0) y[m * y_mat + i * y_pitch + r] = acc;
}

constexpr int kThreads = 256;

inline unsigned blocks_for(int64_t threads) { return unsigned((threads + kThreads - 1) / kThreads); }

template <class Block>
void launch_q_batched(const void *w, uint64_t w_stride, int64_t n_mat, int64_t rows, int64_t k, const ActQ8 *act,
                      int64_t n, float *y, int64_t y_mat, int64_t y_pitch, cudaStream_t st) {
    const int64_t n_tiles = (n + kTokTile - 1) / kTokTile;
    gemv_q_batched_kernel<Block><<<dim3(blocks_for(rows * n_tiles * 32), unsigned(n_mat)), kThreads, 0, st>>>(
        w, w_stride, rows, k, act, n, y, y_mat, y_pitch);
}

// The plain GEMV, y [n][rows] = W · act: one matrix of the batched kernel.
template <class Block>
void launch_q(const void *w, int64_t rows, int64_t k, const ActQ8 *act, int64_t n, float *y, cudaStream_t st) {
    launch_q_batched<Block>(w, 0, 1, rows, k, act, n, y, 0, rows, st);
}

// The same on float weights, y [n][rows] = W · x [n][k].
template <int Type>
void launch_f(const void *w, int64_t rows, int64_t k, const float *x, int64_t n, float *y, cudaStream_t st) {
    gemv_f_batched_kernel<Type><<<blocks_for(rows * n * 32), kThreads, 0, st>>>(w, 0, rows, k, x, 0, k, n, y, 0, rows);
}

// y [rows][n]: one block per row; the sum of squares in double, as the CPU's rms_norm (in another
// order: a tree over the block's threads).
__global__ void rmsnorm_kernel(const float *x, const float *w, float *y, int64_t n, float eps) {
    __shared__ double part[256];
    const float *xr = x + int64_t(blockIdx.x) * n;
    float *yr = y + int64_t(blockIdx.x) * n;
    double ss = 0.0;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) ss += double(xr[i]) * double(xr[i]);
    part[threadIdx.x] = ss;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s /= 2) {
        if (int(threadIdx.x) < s) part[threadIdx.x] += part[threadIdx.x + s];
        __syncthreads();
    }
    const float scale = float(1.0 / sqrt(part[0] / double(n) + double(eps)));
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) yr[i] = w ? xr[i] * scale * w[i] : xr[i] * scale;
}

// One block per token: thread 0 computes the angles into shared memory, then the block rotates
// every pair of every head.
__global__ void rope_kernel(KtdRope rp, const float *freq_factors, const int32_t *pos, float *x, int n_heads,
                            int64_t head_dim) {
    extern __shared__ float cs[];
    if (threadIdx.x == 0) rope_cos_sin(rp, freq_factors, pos[blockIdx.x], cs);
    __syncthreads();
    const int half = rp.n_rot / 2;
    float *xt = x + int64_t(blockIdx.x) * n_heads * head_dim;
    for (int j = threadIdx.x; j < n_heads * half; j += blockDim.x) rope_pair(rp, cs, xt + (j / half) * head_dim, j % half);
}

__global__ void glu_kernel(int act, float *a, const float *b, int64_t n) {
    const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i < n) a[i] = glu_act(act, a[i]) * b[i];
}

__global__ void scale_kernel(float *x, int64_t n, float s) {
    const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i < n) x[i] *= s;
}

__global__ void gather_rows_kernel(float *dst, const float *src, const int32_t *idx, int64_t n, int64_t width) {
    const int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    if (e < n * width) dst[e] = src[int64_t(idx[e / width]) * width + e % width];
}

__global__ void scatter_add_rows_kernel(float *y, const float *src, const int32_t *idx, const float *w, int64_t n,
                                        int64_t width) {
    const int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    if (e < n * width) y[int64_t(idx[e / width]) * width + e % width] += w[e / width] * src[e];
}

__global__ void add_kernel(float *a, const float *b, int64_t n) {
    const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i < n) a[i] += b[i];
}

// One warp per (token, query head), online softmax over the token's keys: each lane holds hd/32
// of the head's query and output dims, a key's score is a warp reduction. Token i (blockIdx.x,
// head blockIdx.y, reading KV head h / (n_head / n_head_kv)) reads cache rows [kv_first[i],
// kv_first[i] + n_kv[i]) (null arrays: rows [0, n_kv_all) for every token); cache row t holds KV
// head j's key at k + t·k_row + j·hd_k and its value at v + t·v_row + j·hd_v. q [n_tok][n_head]
// [hd_k], out [n_tok][n_head][hd_v], hd_v <= hd_k <= kMax. GQA: k_row = v_row = n_head_kv·hd;
// MLA's latent cache: one KV head whose value is the first hd_v entries of its key (v = k).
constexpr int kMaxHd = 256;      // GQA heads (ktd_cuda_attention)
constexpr int kMaxHdMla = 1024;  // MLA cache rows (ktd_cuda_attention_mla)
template <int kMax>
__global__ void attn_kernel(const float *q, const __half *k, int64_t k_row, const __half *v, int64_t v_row, float *out,
                            int n_head, int n_head_kv, int64_t hd_k, int64_t hd_v, const int64_t *kv_first,
                            const int32_t *n_kvs, int64_t n_kv_all, float scale) {
    const int h = blockIdx.y;
    const int64_t tok = blockIdx.x;
    const int64_t first = kv_first ? kv_first[tok] : 0, n_kv = n_kvs ? n_kvs[tok] : n_kv_all;
    const int kvh = h / (n_head / n_head_kv);
    q += (tok * n_head + h) * hd_k;
    out += (tok * n_head + h) * hd_v;
    k += first * k_row + int64_t(kvh) * hd_k;
    v += first * v_row + int64_t(kvh) * hd_v;
    const int lane = threadIdx.x;
    float qv[kMax / 32], acc[kMax / 32];
    const int per_k = int((hd_k + 31) / 32), per_v = int((hd_v + 31) / 32);
    for (int j = 0; j < per_k; ++j) {
        const int64_t d = lane + 32 * j;
        qv[j] = d < hd_k ? q[d] : 0.0f;
    }
    for (int j = 0; j < per_v; ++j) acc[j] = 0.0f;
    float m = -INFINITY, l = 0.0f;
    for (int64_t t = 0; t < n_kv; ++t) {
        const __half *kt = k + t * k_row;
        float s = 0.0f;
        for (int j = 0; j < per_k; ++j) {
            const int64_t d = lane + 32 * j;
            if (d < hd_k) s += qv[j] * __half2float(kt[d]);
        }
        for (int off = 16; off > 0; off /= 2) s += __shfl_xor_sync(0xffffffffu, s, off);
        s *= scale;
        const float m2 = fmaxf(m, s);
        const float corr = expf(m - m2), p = expf(s - m2);
        l = l * corr + p;
        const __half *vt = v + t * v_row;
        for (int j = 0; j < per_v; ++j) {
            const int64_t d = lane + 32 * j;
            acc[j] = acc[j] * corr + (d < hd_v ? p * __half2float(vt[d]) : 0.0f);
        }
        m = m2;
    }
    for (int j = 0; j < per_v; ++j) {
        const int64_t d = lane + 32 * j;
        if (d < hd_v) out[d] = l > 0.0f ? acc[j] / l : 0.0f;
    }
}

}  // namespace

namespace {

// cache row rows[i] = f16(src [i]), one thread per element.
__global__ void kv_write_kernel(const float *src, int64_t n_tok, int64_t width, __half *cache, const int64_t *rows) {
    const int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    if (e >= n_tok * width) return;
    const int64_t i = e / width, d = e % width;
    cache[rows[i] * width + d] = __float2half_rn(src[e]);
}

__global__ void add_rows_kernel(float *y, const float *b, int64_t n, int64_t width) {
    const int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    if (e < n * width) y[e] += b[e % width];
}

__global__ void gate_rows_kernel(float *y, const float *g, int64_t n, int64_t width) {
    const int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    if (e < n * width) y[e] *= 1.0f / (1.0f + expf(-g[e / width]));
}

}  // namespace
