// The CPU backend's per-sequence memory of an attention layer (sequence_memory.h), F16 in host
// memory: K [n_seq_max][n_head_kv][n_ctx][hd_k] and V [n_seq_max][n_head_kv][n_ctx][hd_v]. Each
// KV head's rows of a sequence are contiguous, so the attention over one head reads one stream.
// Not value-initialized: pages are touched only as positions are written.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>

#include "model/sequence_memory.h"

namespace ktd {

struct HParams;

// Elements before the first cached row of (sequence seq, KV head h) in a layer's cache of
// n_head_kv heads of head dim hd and n_ctx positions per sequence ([n_seq][n_head_kv][n_ctx][hd]).
inline size_t kv_head_offset(int64_t seq, int64_t h, int64_t n_head_kv, int64_t n_ctx, int64_t hd) {
    return ((size_t(seq) * size_t(n_head_kv) + size_t(h)) * size_t(n_ctx)) * size_t(hd);
}

class KvCache : public LayerMemory {
public:
    // hd_v 0: no V rows (LatentCache).
    KvCache(int n_seq_max, int64_t n_ctx, int64_t n_head_kv, int64_t hd_k, int64_t hd_v);

    int64_t bytes_per_token() const override;
    void copy_seq(int src, int dst, int64_t n_tokens) override;
    void free_seq(int) override {}

    uint16_t *k() const { return k_.get(); }
    uint16_t *v() const { return v_.get(); }  // null without V rows
    int64_t n_ctx() const { return n_ctx_; }
    int64_t n_head_kv() const { return n_head_kv_; }

private:
    int64_t n_ctx_, n_head_kv_, hd_k_, hd_v_;
    std::unique_ptr<uint16_t[]> k_, v_;
};

// MLA's latent cache (deepseek2): per position one row of kv_lora_rank + qk_rope_head_dim values,
// the normed latent and the roped key all heads share. The attention reads it as the keys of
// multi-query attention (one KV head) and its first kv_lora_rank values as the values: no V rows.
class LatentCache final : public KvCache {
public:
    LatentCache(int n_seq_max, int64_t n_ctx, int64_t row) : KvCache(n_seq_max, n_ctx, 1, row, 0) {}
};

// The cache an attention layer of this model keeps: a LatentCache (MLA) or a KvCache.
std::unique_ptr<KvCache> make_kv_cache(const HParams &hp, int n_seq_max, int64_t n_ctx);

}  // namespace ktd
