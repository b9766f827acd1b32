#include "model/kv_cache.h"

#include <cstring>

#include "model/hparams.h"

namespace ktd {

KvCache::KvCache(int n_seq_max, int64_t n_ctx, int64_t n_head_kv, int64_t hd_k, int64_t hd_v)
    : n_ctx_(n_ctx), n_head_kv_(n_head_kv), hd_k_(hd_k), hd_v_(hd_v) {
    const size_t rows = size_t(n_seq_max) * size_t(n_ctx) * size_t(n_head_kv);
    k_.reset(new uint16_t[rows * size_t(hd_k)]);
    if (hd_v > 0) v_.reset(new uint16_t[rows * size_t(hd_v)]);
}

int64_t KvCache::bytes_per_token() const { return n_head_kv_ * (hd_k_ + hd_v_) * int64_t(sizeof(uint16_t)); }

void KvCache::copy_seq(int src, int dst, int64_t n_tokens) {
    // The first n_tokens rows of each KV head.
    for (auto [cache, hd] : {std::pair{k_.get(), hd_k_}, std::pair{v_.get(), hd_v_}}) {
        if (!cache) continue;
        for (int64_t h = 0; h < n_head_kv_; ++h)
            std::memcpy(cache + kv_head_offset(dst, h, n_head_kv_, n_ctx_, hd),
                        cache + kv_head_offset(src, h, n_head_kv_, n_ctx_, hd),
                        size_t(n_tokens) * size_t(hd) * sizeof(uint16_t));
    }
}

std::unique_ptr<KvCache> make_kv_cache(const HParams &hp, int n_seq_max, int64_t n_ctx) {
    if (hp.is_mla()) return std::make_unique<LatentCache>(n_seq_max, n_ctx, hp.n_embd_k_cache());
    return std::make_unique<KvCache>(n_seq_max, n_ctx, hp.n_head_kv, hp.head_dim_k, hp.head_dim_v);
}

}  // namespace ktd
