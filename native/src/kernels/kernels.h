// Matrix kernels for GGUF block types.
//
// Conventions (GGML order, as in the file):
//   W  [rows][k]   weights, row-major; each row is k elements = k/blck blocks of the weight type
//   X  [n][k]      activations, F32, one row per token (a column of the maths' X[k×n])
//   Y  [n][rows]   output, F32, one row per token:  Y[c][r] = Σ_i W[r][i] · X[c][i]
//
// Activations are quantized once per op into the weight type's activation format (`act_type`:
// Q8_0 for the 32-element block types, Q8_K for the 256-element ones, F32 for float weights) so
// the inner loops are integer dot products with the weight dequantization fused in registers.
//
// Every (type, ISA) pair is one TypeKernels entry registered at load time by the file that
// implements it (KTD_REGISTER_KERNELS below). The scalar reference (Isa::Ref) is the
// specification: every other ISA's entry must agree with it within the activation-quantization
// error stated per type in the tests (tests/kernels/test_kernels_q32.py for the 32-element and float types,
// tests/kernels/test_kernels_k.py for the 256-element ones).
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "common/ggml_types.h"

namespace ktd {

class Arena;
class ThreadPool;

// x86-64: AVX2, AVX512; aarch64: NEON (Armv8-A Advanced SIMD), DOTPROD (+ SDOT, Armv8.2-A),
// I8MM (+ SMMLA, the int8 matrix multiply). A build compiles only its target's ISAs
// (CMakeLists.txt); the others are never compiled in.
enum class Isa : int { Ref = 0, AVX2 = 1, AVX512 = 2, NEON = 3, DOTPROD = 4, I8MM = 5 };
constexpr int kIsaCount = 6;
constexpr Isa kAllIsas[] = {Isa::Ref, Isa::AVX2, Isa::AVX512, Isa::NEON, Isa::DOTPROD, Isa::I8MM};
std::string_view isa_name(Isa isa);
// The ISA whose kernels a family without an entry for `isa` uses next: AVX512 → AVX2,
// I8MM → DOTPROD, DOTPROD → NEON, the others → Ref (Ref → Ref). Each step is a subset of the ISA before it, so
// a CPU that runs `isa` runs its fallbacks.
Isa isa_fallback(Isa isa);

struct TypeKernels {
    GGMLType type = GGMLType::F32;
    GGMLType act_type = GGMLType::F32;
    // One row of k weights (k % blck == 0) → k floats.
    void (*dequantize_row)(const void *w, float *y, int64_t k) = nullptr;
    // One row of k floats → the act_type blocks of that row.
    void (*quantize_act_row)(const float *x, void *xq, int64_t k) = nullptr;
    // Tile: for r < nr, c < nc:  y[c * ldy + r] = dot(W row r, activation row c)
    // W row r at (const char *)w + r * w_stride; activation row c at (const char *)xq + c * x_stride.
    void (*gemm)(int64_t k, const void *w, size_t w_stride, const void *xq, size_t x_stride,
                 float *y, size_t ldy, int nr, int nc) = nullptr;

    // Optional load-time repacking into a row-interleaved layout (repack_rows == 0: none).
    // Rows are interleaved in groups of repack_rows (R, a divisor of 16) so one SIMD load covers
    // R rows' blocks; group g holds rows [g*R, g*R + R) in repacked_group_bytes(k) bytes, groups
    // stored one after another; a last partial group is padded with zero rows. repack_layout is
    // the layout's version: anything that caches repacked weights keys on it.
    int repack_rows = 0;
    uint32_t repack_layout = 0;
    size_t (*repacked_group_bytes)(int64_t k) = nullptr;
    // Writes groups [g0, g1) of W [rows][k] (row stride w_stride) into `out` (the whole repacked
    // buffer); disjoint group ranges may be repacked concurrently.
    void (*repack)(const void *w, size_t w_stride, int64_t rows, int64_t k, int64_t g0, int64_t g1,
                   void *out) = nullptr;
    // The tile on repacked weights: wp = the group holding row 0 of the tile (nr rows, from a
    // group boundary), group_stride = repacked_group_bytes(k); same y convention as gemm, and only
    // rows r < nr are written.
    void (*gemm_repacked)(int64_t k, const void *wp, size_t group_stride, const void *xq, size_t x_stride,
                          float *y, size_t ldy, int nr, int nc) = nullptr;
    // The repacked layout streams slower than the plain rows at one activation row (GEMV) and pays
    // only for prefill's GEMM: a matrix that is only ever multiplied by one row per sequence (the
    // output head) keeps the plain rows (model_load.cpp, repack_matrix). Set from measurements.
    bool gemv_plain = false;
};

void register_type_kernels(Isa isa, const TypeKernels &tk);
// The entry for (type, isa) or nullptr.
const TypeKernels *find_type_kernels(GGMLType type, Isa isa);
// The entry used at run time for `type`: the active ISA's if it has one, else (for AVX-512) the
// AVX2 one, else the reference.
const TypeKernels *kernels_for(GGMLType type);
// Types with an entry for `isa`.
std::vector<GGMLType> supported_types(Isa isa);

// ISAs: Ref (the scalar specification, every CPU), AVX2 (AVX2 + FMA + F16C + BMI2) and AVX512
// (F/BW/VL/DQ + VNNI + VBMI) on x86-64; NEON (Advanced SIMD, every aarch64 CPU), DOTPROD
// (+ asimddp) and I8MM (+ asimddp + i8mm) on aarch64. The active ISA is chosen once at first use
// from CPUID (x86-64: AVX2 where the CPU has it, else Ref) or the hwcaps (aarch64: I8MM, else
// DOTPROD, else NEON, the first the CPU has); KTD_ISA=ref|avx2|avx512|neon|dotprod|i8mm (or
// set_active_isa) overrides. Under that default,
// the types whose AVX-512 kernels were measured faster (Q4_K, Q6_K, Q5_0, Q8_0) use them where
// the CPU has AVX-512 VNNI (kernels_for); KTD_ISA=avx512 uses every AVX-512 kernel, and AVX2 for
// the types that have none.
bool isa_supported_by_cpu(Isa isa);
bool isa_compiled(Isa isa);
Isa active_isa();
// True when KTD_ISA or set_active_isa fixed the ISA: then no kernel family prefers another ISA.
bool isa_chosen_explicitly();
void set_active_isa(Isa isa);  // throws std::invalid_argument if not compiled or not supported
Isa parse_isa(std::string_view name);  // throws std::invalid_argument

// Software prefetch in the decode (n = 1) GEMV of the repacked x86 layouts (the K-quants' 8-row
// tiles, kernels/x86/k_repack.h; the 32-element types' 8- and 16-row tiles, kernels/avx2/q32.h and
// kernels/avx512/q32_vnni.h), one of three modes: off; l1, prefetcht0 a few KiB ahead of the
// weight stream (8 KiB in the K-quant tiles, 4 KiB in the others); l2, prefetcht1 kPrefetchL2Bytes
// ahead in every layout, paced (kernels/x86/common.h prefetch_lines). Which pays depends on the
// core, not on the ISA tier: l1 measured faster on a Xeon and on an AMD Zen 3, slower on an AMD
// Zen 4; on another Xeon l1 made a DRAM-bound decode about a quarter slower and l2 about an eighth
// faster than off (docs/perf/ has the figures, per CPU). The default is off on AMD Zen 4 and
// later, l2 on Intel, l1 elsewhere (k_decode_prefetch_default), then tuned by the first one-row
// forwards (k_decode_prefetch_tune_begin below). KTD_DECODE_PREFETCH=0|1|2 or off|l1|l2 (read
// once, at first use) or set_k_decode_prefetch overrides; set_k_decode_prefetch(-1) goes back to
// the default (and to tuning). Prefill (n > 1) follows the same mode in its first column tile only.
constexpr int kPrefetchOff = 0, kPrefetchL1 = 1, kPrefetchL2 = 2, kPrefetchModes = 3;
// The l2 distance: 9 KiB, not a multiple of 4 KiB. Changed alone at run time on a Xeon, the
// distances that are a multiple of 4 KiB (4, 8, 12, 16 KiB), and those whose prefetched block
// spans one (7.5-7.9 KiB), made decode steps 5-10% slower than 9 KiB, which beat the 2304 bytes
// the K-quant tiles had by 4-5% and was among the fastest for every repacked type
// (docs/perf/2026-12-04-intel-xeon-480mib-l3.md). Why the multiples of 4 KiB are slow is not
// established. One distance serves every layout.
constexpr size_t kPrefetchL2Bytes = 9216;
const char *prefetch_mode_name(int mode);  // "off", "l1", "l2"
int k_decode_prefetch();                   // the mode
void set_k_decode_prefetch(int mode);      // a mode, or -1 = the default (std::invalid_argument otherwise)
// The default for this CPU (a mode).
int k_decode_prefetch_default();

// Tuning the decode prefetch on this machine. Two Xeons measured l1 opposite ways (one 1.4-2x
// faster with it, another's Qwen2.5-Coder-1.5B decode 1.36x slower), so unless KTD_DECODE_PREFETCH
// or set_k_decode_prefetch fixed it, the process's first one-row forwards (Context::forward)
// measure it: the modes in turn, kPrefetchTuneSteps steps each; then the fastest median stays if
// it is faster than the CPU default's by more than kPrefetchTuneMargin, else the default. The
// sums are the same in every mode: only time depends on it.
constexpr int kPrefetchTuneSteps = 9;
constexpr double kPrefetchTuneMargin = 0.05;
// Before a one-row forward: the mode this step runs with while tuning, -1 otherwise.
int k_decode_prefetch_tune_begin();
// After it: the step's wall time in ns for that mode.
void k_decode_prefetch_tune_end(int mode, uint64_t ns);
struct DecodePrefetchState {
    int mode;
    const char *source;  // "env", "set" (set_k_decode_prefetch), "default", "tuning", "tuned"
    double median_ms[kPrefetchModes];  // the medians measured per mode (0 before the tuning ends)
};
DecodePrefetchState k_decode_prefetch_state();

// Bytes of one activation row of k elements for a type (its act_type row size).
size_t act_row_size(const TypeKernels &tk, int64_t k);

// Y = W · X as above, multi-threaded over the pool (or on the calling thread if pool is null).
// `scratch` holds the quantized activations and is grown only when too small (no allocation on
// the hot path once warm).
struct MatmulScratch {
    std::vector<uint8_t> act;
    // Small batches (decode): every worker quantizes the few activation rows itself into its own
    // 64-byte aligned slice of this buffer instead of sharing `act` behind a barrier.
    std::vector<uint8_t> act_private;
};

void matmul(ThreadPool *pool, const TypeKernels &tk, const void *w, size_t w_row_bytes, int64_t rows,
            int64_t k, const float *x, int64_t n, float *y, MatmulScratch &scratch);

// Repacking (for types with tk.repack_rows > 0): bytes of the repacked [rows][k] matrix, and the
// repack itself, parallel over row groups. Throws std::invalid_argument if the type has none.
size_t repacked_size(const TypeKernels &tk, int64_t rows, int64_t k);
void repack_weights(ThreadPool *pool, const TypeKernels &tk, const void *w, size_t w_row_bytes, int64_t rows,
                    int64_t k, void *out);
// matmul on weights produced by repack_weights (same result as matmul on the originals; bitwise
// for a given ISA when the type's gemm_repacked keeps the plain gemm's summation order).
void matmul_repacked(ThreadPool *pool, const TypeKernels &tk, const void *wp, int64_t rows, int64_t k,
                     const float *x, int64_t n, float *y, MatmulScratch &scratch);

struct PreparedCopies;

// A weight matrix ready for matmul: repacked into the active kernels' interleaved layout when
// they have one (and it was allowed), otherwise the original rows (not copied: `w` must outlive
// it). The forward prepares each weight once at load time and calls matmul(pool, pw, ...).
struct PreparedWeights {
    const TypeKernels *tk = nullptr;
    const void *data = nullptr;  // original rows or the repacked bytes
    size_t row_bytes = 0;        // bytes of one original row
    int64_t rows = 0, k = 0;
    bool repacked = false;
    size_t repacked_bytes = 0;   // 0 when not repacked
    // Keeps the repacked bytes alive: their heap buffer, or the weights arena they were carved
    // from (shared by every matrix of a model). Null when not repacked.
    std::shared_ptr<const void> storage;
    // NUMA replication (the model's numa.dense: replicate): one copy per node of the pool, and the
    // copy worker tid reads (its node's). Null: this is the only copy. matmul honours it.
    std::shared_ptr<const PreparedCopies> node_copies;
    // The copy worker tid of the model's pool reads (defined in matmul.cpp, baseline ISA: not
    // inline, so no ISA-flagged translation unit can provide it).
    const PreparedWeights &for_worker(int tid) const;
};
struct PreparedCopies {
    std::vector<PreparedWeights> copies;  // [n_node], identical bytes
    std::vector<int> copy_of_tid;         // [n_threads] index into copies
};

// Alignment of the repacked bytes in an arena, and the arena bytes prepare_weights will take for
// a matrix (0 when it stays as it is): sum this over a model's matrices to size its arena.
constexpr size_t kPreparedAlign = 64;
size_t prepared_bytes(const TypeKernels &tk, int64_t rows, int64_t k, bool allow_repack = true);
// arena null: repacked bytes in a heap buffer. Otherwise they are bump-allocated from `arena`
// (ResourceError when it is full); the result keeps the arena alive. The repack runs on the pool,
// so the arena's pages are first touched by the workers, in parallel. fill = false (with an
// arena): the same allocation and result, nothing written (the arena's bytes already hold this
// repack: the prepared-weights cache).
PreparedWeights prepare_weights(ThreadPool *pool, const TypeKernels &tk, const void *w, size_t w_row_bytes,
                                int64_t rows, int64_t k, bool allow_repack = true,
                                const std::shared_ptr<Arena> &arena = nullptr, bool fill = true);
void matmul(ThreadPool *pool, const PreparedWeights &pw, const float *x, int64_t n, float *y, MatmulScratch &scratch);

// Several matrices applied to the same input in one pool region (e.g. a layer's Q, K and V):
// Y_j [n][rows_j] = W_j · X (+ bias_j [rows_j] on every row when bias_j is non-null). All W_j have
// the same k. The activations are quantized once per distinct activation format, and the row
// groups of all matrices form one work list that the workers take in contiguous ranges of weight
// bytes, so there is one hand-over instead of one per matrix and no worker idles at the end of a
// small matrix. Each output element is still computed by one worker with the same kernel call as in
// matmul, so the results equal matmul's (then the bias add) bit for bit, for any thread count.
//
// A job's optional hook runs on the worker that computed rows [r0, r1) of Y_j (all n columns, row
// c at y + c·rows, bias added), right after it, while those rows are still in its caches (a decode
// claim's rows: L1 or L2): an epilogue that reads every output once (the greedy argmax of the
// logits) then costs no second pass over them from DRAM. It may modify those rows. It is called
// once for every row of Y_j, in no particular order, from any worker (tid), possibly at the same
// time on different workers.
struct MatmulRowHook {
    void (*fn)(void *ctx, float *y, int64_t rows, int64_t r0, int64_t r1, int64_t n, int tid) = nullptr;
    void *ctx = nullptr;
};
struct MatmulJob {
    const PreparedWeights *pw = nullptr;
    float *y = nullptr;
    const float *bias = nullptr;  // [rows] or null
    const MatmulRowHook *hook = nullptr;
};
void matmul_multi(ThreadPool *pool, const MatmulJob *jobs, int n_jobs, const float *x, int64_t n,
                  MatmulScratch &scratch);

// Two matrices of the same shape on the same input whose outputs are used row by row together (an
// FFN's gate and up, then the GLU): matmul_multi on {a, b} with the two interleaved in the work list
// unit by unit (kRowBlock rows of a, then the same rows of b), so that the worker that computed
// rows [r0, r1) of both (each job's bias and row hook applied) runs
// hook.fn(hook.ctx, ya, yb, rows, r0, r1, n, tid) on them next, while they are in its caches: the
// GLU then needs no pass of its own after the region (on the calling thread alone in decode). Rows
// as in MatmulRowHook (row c of ya at ya + c·rows); every row once, any order, any worker. The
// products equal matmul_multi's bit for bit. std::invalid_argument if the rows differ or hook.fn is
// null.
struct MatmulPairHook {
    void (*fn)(void *ctx, float *ya, float *yb, int64_t rows, int64_t r0, int64_t r1, int64_t n, int tid) = nullptr;
    void *ctx = nullptr;
};
void matmul_pair(ThreadPool *pool, const MatmulJob &a, const MatmulJob &b, const MatmulPairHook &hook, const float *x,
                 int64_t n, MatmulScratch &scratch);

}  // namespace ktd

// Registers a TypeKernels for an ISA when the module loads. Use once per (type, ISA) at namespace
// scope in the file that defines the kernels.
#define KTD_CONCAT_(a, b) a##b
#define KTD_CONCAT(a, b) KTD_CONCAT_(a, b)
#define KTD_REGISTER_KERNELS(isa, ...)                                                        \
    static const bool KTD_CONCAT(ktd_registered_, __LINE__) = [] {                           \
        ::ktd::register_type_kernels(isa, __VA_ARGS__);                                       \
        return true;                                                                          \
    }()
