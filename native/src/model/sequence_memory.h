// What a layer keeps of each sequence between forwards, behind one interface, and the bookkeeping
// of how many tokens each sequence slot holds.
//
// A backend owns the memory of the layers it runs (Backend::memory), in its own memory (host
// arrays, device buffers), and writes it inside its blocks; the context only sees this interface:
// it validates a batch against the slots' lengths and routes free_seq, copy_seq and the byte count
// here, whatever the layers keep. Kinds today:
//   KvCache      F16 K and V rows per position (kv_cache.h; CudaDevice's device copy of it)
//   LatentCache  MLA (deepseek2): one F16 row per position, the normed latent and the roped shared
//                key, read as the keys and (its first kv_lora_rank values) the values; no V
// A new kind is one new LayerMemory class in the backends that run it, and nothing else: a
// linear-attention layer's recurrent state (a fixed [n_head][d_k][d_v] matrix and a short
// convolution tail per sequence, whatever the sequence's length) reports bytes_per_token() 0,
// copies the whole state in copy_seq (a prefix shorter than the source is not a state it holds:
// rewinds() false, so the slots accept only the whole length), zeroes it in free_seq, and starts
// from a zero state in its block where a row's position is 0; a quantized or paged KV cache is a
// KvCache with another row layout or an indirection per block of positions.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace ktd {

// One layer's per-sequence memory for every sequence slot [0, n_seq_max) of a context.
class LayerMemory {
public:
    virtual ~LayerMemory() = default;
    // Bytes one more token of a sequence takes (a KV row; 0 for a fixed-size state).
    virtual int64_t bytes_per_token() const = 0;
    // Slot dst takes what slot src holds of its first n_tokens tokens (0 < n_tokens <= src's
    // length, src != dst; SequenceMemory checks both).
    virtual void copy_seq(int src, int dst, int64_t n_tokens) = 0;
    // Slot seq holds nothing any more (a cache needs no work: the slot's length says which rows
    // are valid).
    virtual void free_seq(int seq) = 0;
    // Whether a sequence can continue from any position up to its length (true: the rows past it
    // are simply rewritten), or only from its length or 0 (a state that holds no per-position
    // history).
    virtual bool rewinds() const { return true; }
};

// The memory of a backend's layers, in layer order, and the tokens each slot holds. Positions
// [0, seq_len(s)) of slot s are valid in every layer.
class SequenceMemory {
public:
    SequenceMemory(int n_seq_max, std::vector<LayerMemory *> layers);

    int n_seq_max() const { return int(len_.size()); }
    int64_t seq_len(int seq) const { return len_[size_t(seq)]; }
    // Bytes of memory one token of a sequence takes over all layers.
    int64_t bytes_per_token() const;
    // std::invalid_argument naming `what` when seq is not a slot.
    void check_seq(int seq, const char *what) const;
    // Whether a batch may start sequence seq's rows at position pos (0 <= pos <= its length, or
    // where some layer does not rewind, pos 0 or its length), and the rule as text for a message.
    bool can_start(int seq, int64_t pos) const;
    std::string start_rule(int seq) const;
    // The forward wrote positions [.., len) of slot seq: its length is len from now on.
    void set_len(int seq, int64_t len) { len_[size_t(seq)] = len; }

    // Context::copy_seq / free_seq: the ids and n_tokens checked (std::invalid_argument), then
    // every layer's memory.
    void copy_seq(int src, int dst, int64_t n_tokens);
    void free_seq(int seq);

private:
    std::vector<LayerMemory *> layers_;  // owned by the backend
    std::vector<int64_t> len_;           // [n_seq_max]
    bool rewinds_ = true;                // every layer rewinds
};

}  // namespace ktd
