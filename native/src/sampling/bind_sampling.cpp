// ktd._native.sampling: the token sampler (sampling/sampler.h). ktd.text.sampling.Sampler calls sample()
// once per token; candidates() and draw() expose its parts to the tests.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <optional>
#include <stdexcept>
#include <string>

#include "bindings.h"
#include "kernels/sampling.h"
#include "sampling/greedy.h"
#include "sampling/sampler.h"

namespace py = pybind11;

namespace ktd {

namespace {

using Floats = py::array_t<float, py::array::c_style | py::array::forcecast>;
using Ids = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

sampling::Params params(double temperature, int64_t top_k, double top_p, double min_p, double repeat_penalty,
                        double presence_penalty, double frequency_penalty) {
    sampling::Params p;
    p.temperature = temperature;
    p.top_k = top_k;
    p.top_p = top_p;
    p.min_p = min_p;
    p.repeat_penalty = repeat_penalty;
    p.presence_penalty = presence_penalty;
    p.frequency_penalty = frequency_penalty;
    return p;
}

// The kernels of a named ISA (for the tests' cross-ISA comparisons), or null: the default.
const SamplingKernels *kernels_of(const std::optional<std::string> &isa) {
    if (!isa) return nullptr;
    const Isa i = parse_isa(*isa);
    if (!isa_supported_by_cpu(i)) throw std::invalid_argument("this CPU does not support ISA " + *isa);
    const SamplingKernels *k = find_sampling_kernels(i);
    if (!k) throw std::invalid_argument("no sampling kernels for ISA " + *isa);
    return k;
}

void check_1d(const py::array &a, const char *what) {
    if (a.ndim() != 1) throw std::invalid_argument(std::string(what) + " must be 1-D");
}

using Words = py::array_t<uint32_t, py::array::c_style | py::array::forcecast>;

// The grammar's bitmask (uint32 words, llguidance's layout; int32 arrays are taken bit for bit),
// checked to cover the vocabulary.
sampling::Mask mask_of(const std::optional<Words> &words, int64_t n_vocab) {
    if (!words) return {};
    check_1d(*words, "mask");
    if (words->shape(0) < (n_vocab + 31) / 32)
        throw std::invalid_argument("mask has " + std::to_string(words->shape(0)) + " words, the vocabulary needs " +
                                    std::to_string((n_vocab + 31) / 32));
    return {words->data()};
}

// int32 bitmasks (llguidance.numpy's) viewed as uint32 without a conversion.
std::optional<Words> words_of(const py::object &mask) {
    if (mask.is_none()) return std::nullopt;
    py::array a = py::array::ensure(mask);
    if (a && a.dtype().is(py::dtype::of<int32_t>())) return Words(a.attr("view")(py::dtype::of<uint32_t>()));
    return Words::ensure(mask);
}

// The greedy code of Context.forward(greedy=True): its error messages and its piecewise reduction.
void bind_greedy(py::module_ &s) {
    s.def("greedy_error", [](int32_t code) -> py::object {
        const char *msg = sampling::greedy_error(code);
        return msg ? py::object(py::str(msg)) : py::object(py::none());
    }, py::arg("code"), "the sampler's message for a negative greedy code of Context.forward(greedy=True); None for a token id");
    s.def("greedy_pieces", [](Floats logits, const std::vector<int64_t> &cuts, const std::vector<int> &order,
                              const std::vector<int> &worker) {
        // The greedy reduction as the output head runs it: the row cut at `cuts` into pieces, added
        // in `order`, piece order[i] by worker worker[i] (each worker its own view), then merged.
        if (logits.ndim() != 1) throw py::value_error("logits must be 1-D");
        const int64_t n = logits.shape(0);
        std::vector<int64_t> b{0};
        for (int64_t c : cuts) {
            if (c <= b.back() || c >= n) throw py::value_error("cuts must ascend strictly inside the row");
            b.push_back(c);
        }
        b.push_back(n);
        const size_t n_piece = b.size() - 1;
        if (order.size() != n_piece || worker.size() != n_piece) throw py::value_error("one order and worker entry per piece");
        int n_workers = 1;
        for (int w : worker) {
            if (w < 0) throw py::value_error("worker ids must be >= 0");
            n_workers = std::max(n_workers, w + 1);
        }
        std::vector<sampling::GreedyBest> views(static_cast<size_t>(n_workers));
        std::vector<bool> seen(n_piece, false);
        for (size_t i = 0; i < n_piece; ++i) {
            const int pc = order[i];
            if (pc < 0 || size_t(pc) >= n_piece || seen[size_t(pc)]) throw py::value_error("order must be a permutation of the pieces");
            seen[size_t(pc)] = true;
            views[size_t(worker[i])].add(logits.data() + b[size_t(pc)], b[size_t(pc)], b[size_t(pc) + 1] - b[size_t(pc)]);
        }
        sampling::GreedyBest best = views[0];
        for (size_t w = 1; w < views.size(); ++w) best.merge(views[w]);
        return best.result();
    }, py::arg("logits"), py::arg("cuts"), py::arg("order"), py::arg("worker"),
       "tests: the greedy code of a row added piece by piece (see Context.forward(greedy=True))");
}

// The sampler: one token from a row of logits, and its parts (the candidates, the draw).
void bind_sampler(py::module_ &s) {
    s.def("kernel_isas", [] {
        std::vector<std::string> out;
        for (Isa i : kAllIsas)
            if (find_sampling_kernels(i)) out.emplace_back(isa_name(i));
        return out;
    }, "ISAs with their own sampling kernels (isa= of sample/candidates/draw; the CPU must support it)");
    s.def(
        "sample",
        [](Floats logits, Ids window, double temperature, int64_t top_k, double top_p, double min_p,
           double repeat_penalty, double presence_penalty, double frequency_penalty, double u,
           std::optional<std::string> isa, py::object mask, int logprobs) -> py::object {
            check_1d(logits, "logits");
            check_1d(window, "window");
            const sampling::Params p =
                params(temperature, top_k, top_p, min_p, repeat_penalty, presence_penalty, frequency_penalty);
            const SamplingKernels *k = kernels_of(isa);
            const std::optional<Words> words = words_of(mask);
            const sampling::Mask allowed = mask_of(words, logits.shape(0));
            sampling::Logprobs lp;
            lp.n_top = logprobs;
            int32_t token;
            {
                py::gil_scoped_release release;
                token = sampling::sample(logits.data(), logits.shape(0), window.data(), window.shape(0), p, u, k,
                                         allowed, logprobs >= 0 ? &lp : nullptr);
            }
            if (logprobs < 0) return py::int_(token);
            py::array_t<int32_t> ids(py::ssize_t(lp.top_ids.size()));
            py::array_t<double> top(py::ssize_t(lp.top.size()));
            std::copy(lp.top_ids.begin(), lp.top_ids.end(), ids.mutable_data());
            std::copy(lp.top.begin(), lp.top.end(), top.mutable_data());
            return py::make_tuple(token, lp.token, ids, top);
        },
        py::arg("logits"), py::arg("window"), py::arg("temperature"), py::arg("top_k"), py::arg("top_p"),
        py::arg("min_p"), py::arg("repeat_penalty"), py::arg("presence_penalty"), py::arg("frequency_penalty"),
        py::arg("u"), py::arg("isa") = py::none(), py::arg("mask") = py::none(), py::arg("logprobs") = -1,
        "One token id from float32 logits [n_vocab]; window: recent token ids for the penalties; u in [0, 1) "
        "(the draw's uniform; ignored when temperature is 0). mask: the grammar's bitmask (uint32 or int32 words, "
        "bit i % 32 of word i / 32 = token i allowed), masked tokens are never drawn. logprobs >= 0: returns "
        "(token, its logprob, top ids int32, their logprobs float64) with that many alternatives (<= 20), "
        "log_softmax of the logits as given. ValueError on NaN/+inf logits or bad parameters.");
    s.def(
        "candidates",
        [](Floats logits, Ids window, double temperature, int64_t top_k, double top_p, double min_p,
           double repeat_penalty, double presence_penalty, double frequency_penalty, std::optional<std::string> isa,
           py::object mask) {
            check_1d(logits, "logits");
            check_1d(window, "window");
            const sampling::Params p =
                params(temperature, top_k, top_p, min_p, repeat_penalty, presence_penalty, frequency_penalty);
            const SamplingKernels *k = kernels_of(isa);
            const std::optional<Words> words = words_of(mask);
            const sampling::Mask allowed = mask_of(words, logits.shape(0));
            sampling::Candidates c;
            {
                py::gil_scoped_release release;
                c = sampling::candidates(logits.data(), logits.shape(0), window.data(), window.shape(0), p, k, allowed);
            }
            py::array_t<int32_t> ids(py::ssize_t(c.ids.size()));
            py::array_t<float> w(py::ssize_t(c.weights.size()));
            std::copy(c.ids.begin(), c.ids.end(), ids.mutable_data());
            std::copy(c.weights.begin(), c.weights.end(), w.mutable_data());
            return py::make_tuple(ids, w, std::string(c.top_p_path));
        },
        py::arg("logits"), py::arg("window"), py::arg("temperature"), py::arg("top_k"), py::arg("top_p"),
        py::arg("min_p"), py::arg("repeat_penalty"), py::arg("presence_penalty"), py::arg("frequency_penalty"),
        py::arg("isa") = py::none(), py::arg("mask") = py::none(),
        "(ids int32 ascending, weights float32, top_p_path): the tokens sample() draws from (weight > 0) and "
        "how the top-p cut was found ('', 'heavy', 'middle', 'tail' or 'sort': see sampling/sampler.h).");
    s.def(
        "draw",
        [](Floats w, double u, std::optional<std::string> isa) {
            check_1d(w, "w");
            const SamplingKernels *k = kernels_of(isa);
            py::gil_scoped_release release;
            return sampling::draw(w.data(), w.shape(0), u, k);
        },
        py::arg("w"), py::arg("u"), py::arg("isa") = py::none(),
        "Position drawn from weights w (>= 0) at u in [0, 1): the first whose cumulative weight exceeds u·Σw.");
}

}  // namespace

void bind_sampling(py::module_ &m) {
    auto s = m.def_submodule("sampling", "token sampling (penalties, temperature, top-k, top-p, min-p, draw)");
    bind_greedy(s);
    bind_sampler(s);
}

}  // namespace ktd
