// IQ4_NL weights (w = d * kvalues_iq4nl[q]), AVX2+FMA; activations Q8_0. The code book lookup is
// one byte shuffle per block; the kernels are kernels/avx2/q32_kernels.h's (signed family).
#include "kernels/avx2/q32_kernels.h"
#include "kernels/kernels.h"

namespace ktd::avx2 {

namespace {
inline __m256i iq4nl_book() {
    const __m128i book = _mm_loadu_si128(reinterpret_cast<const __m128i *>(kvalues_iq4nl));
    return _mm256_set_m128i(book, book);
}
struct IQ4_NLValues {
    static __m256i q(const block_iq4_nl &x) { return _mm256_shuffle_epi8(iq4nl_book(), unpack_nibbles(x.qs)); }
};
struct IQ4_NLx8Load {
    static void load(const block_iq4_nlx8 &g, __m256i v[8]) {
        const __m256i book2 = iq4nl_book();
        load_nibbles(g.qs, v);
        for (int j = 0; j < 8; ++j) v[j] = _mm256_shuffle_epi8(book2, v[j]);
    }
};
}  // namespace

KTD_REGISTER_KERNELS(Isa::AVX2, q32_entry(GGMLType::IQ4_NL, dequantize_row_signed<block_iq4_nl, IQ4_NLValues, 0>,
                                          gemm_q8_0_act<SignedDot<block_iq4_nl, IQ4_NLValues>>,
                                          gemm_repacked_r8<SignedDotX8<block_iq4_nlx8, IQ4_NLx8Load>>));

}  // namespace ktd::avx2
