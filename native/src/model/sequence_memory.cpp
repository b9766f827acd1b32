#include "model/sequence_memory.h"

#include <algorithm>
#include <stdexcept>

namespace ktd {

SequenceMemory::SequenceMemory(int n_seq_max, std::vector<LayerMemory *> layers)
    : layers_(std::move(layers)), len_(size_t(n_seq_max), 0) {
    rewinds_ = std::all_of(layers_.begin(), layers_.end(), [](const LayerMemory *l) { return l->rewinds(); });
}

int64_t SequenceMemory::bytes_per_token() const {
    int64_t b = 0;
    for (const LayerMemory *l : layers_) b += l->bytes_per_token();
    return b;
}

void SequenceMemory::check_seq(int seq, const char *what) const {
    if (seq < 0 || seq >= n_seq_max())
        throw std::invalid_argument(std::string(what) + ": sequence id " + std::to_string(seq) +
                                    " out of range [0, " + std::to_string(n_seq_max()) + ")");
}

bool SequenceMemory::can_start(int seq, int64_t pos) const {
    const int64_t len = seq_len(seq);
    return rewinds_ ? pos >= 0 && pos <= len : pos == 0 || pos == len;
}

std::string SequenceMemory::start_rule(int seq) const {
    const std::string len = std::to_string(seq_len(seq));
    return rewinds_ ? "at most " + len : "0 or " + len;
}

void SequenceMemory::copy_seq(int src, int dst, int64_t n_tokens) {
    check_seq(src, "copy_seq");
    check_seq(dst, "copy_seq");
    const int64_t len = seq_len(src);
    if (n_tokens < 0 || n_tokens > len)
        throw std::invalid_argument("copy_seq: n_tokens " + std::to_string(n_tokens) + " exceeds the " +
                                    std::to_string(len) + " tokens of sequence " + std::to_string(src));
    if (!rewinds_ && n_tokens != len && n_tokens != 0)
        throw std::invalid_argument("copy_seq: the layers keep a state, not a row per token: only all " +
                                    std::to_string(len) + " tokens of sequence " + std::to_string(src) +
                                    " can be copied, not " + std::to_string(n_tokens));
    if (src != dst && n_tokens > 0)
        for (LayerMemory *l : layers_) l->copy_seq(src, dst, n_tokens);
    if (n_tokens == 0)
        for (LayerMemory *l : layers_) l->free_seq(dst);
    set_len(dst, n_tokens);
}

void SequenceMemory::free_seq(int seq) {
    check_seq(seq, "free_seq");
    for (LayerMemory *l : layers_) l->free_seq(seq);
    set_len(seq, 0);
}

}  // namespace ktd
