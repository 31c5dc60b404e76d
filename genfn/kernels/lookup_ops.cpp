// Prompt lookup's proposal in one native call: genfn.strategies.assisted.prompt_lookup's
// propose_prompt_lookup, row by row.
//
// The torch formulation compares every window of the token buffer with the row's last n-gram, for
// each n-gram size, in ~80 small tensor ops. A compiled step fuses them; an eager one dispatched each,
// ~0.17 ms a round against ~0.02 here (benchmarks/lookup_proposal.py, Zen 4), for what is a scan of
// a few hundred int64s. Here a row scans
// its filled columns once per n-gram size, nearest window first for "latest", and stops at the first
// match. The result is the torch formulation's, tensor for tensor: the same start column, the same
// draft (garbage columns included, read at the clamped column), the same num_valid.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <tuple>

namespace {

// The first column of the continuation after the chosen window, or -1 when no window matches.
int64_t match_start(const int64_t* row, int64_t length, int64_t first, int64_t max_ngram, bool latest) {
  for (int64_t n = max_ngram; n >= 1; --n) {
    // The row's last n-gram must lie in its real tokens, and a window must end before it so that a
    // token follows it: windows j in [first, length - n).
    if (length - n <= first) continue;
    const int64_t* ngram = row + length - n;
    const int64_t count = length - n - first;
    for (int64_t i = 0; i < count; ++i) {
      const int64_t j = latest ? length - n - 1 - i : first + i;
      if (std::equal(ngram, ngram + n, row + j)) return j + n;
    }
  }
  return -1;
}

std::tuple<at::Tensor, at::Tensor> propose_prompt_lookup(const at::Tensor& tokens, const at::Tensor& cur_len,
                                                         const std::optional<at::Tensor>& first_column,
                                                         const std::optional<at::Tensor>& max_length,
                                                         at::IntArrayRef eos_token_ids, int64_t num_output_tokens,
                                                         int64_t max_matching_ngram_size, bool latest) {
  TORCH_CHECK(tokens.device().is_cpu() && tokens.dim() == 2 && tokens.scalar_type() == at::kLong,
              "propose_prompt_lookup: `tokens` must be an int64 [batch, N] CPU tensor, got ", tokens.sizes(), " ",
              tokens.scalar_type());
  const int64_t B = tokens.size(0), width = tokens.size(1), k = num_output_tokens;
  auto row_vector = [&](const at::Tensor& t, const char* name) {
    TORCH_CHECK(t.device().is_cpu() && t.dim() == 1 && t.size(0) == B && t.scalar_type() == at::kLong,
                "propose_prompt_lookup: `", name, "` must be an int64 [", B, "] CPU tensor, got ", t.sizes(), " ",
                t.scalar_type());
    return t.contiguous();
  };
  TORCH_CHECK(k >= 1 && max_matching_ngram_size >= 1,
              "propose_prompt_lookup: num_output_tokens and max_matching_ngram_size must be >= 1");
  const at::Tensor rows = tokens.contiguous();
  const at::Tensor lengths = row_vector(cur_len, "cur_len");
  const at::Tensor firsts = first_column ? row_vector(*first_column, "first_column") : at::Tensor();
  const at::Tensor limits = max_length ? row_vector(*max_length, "max_length") : at::Tensor();
  at::Tensor draft = at::empty({B, k}, tokens.options());
  at::Tensor num_valid = at::empty({B}, tokens.options());
  const int64_t max_ngram = std::min(max_matching_ngram_size, width - 1);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t* row = rows.data_ptr<int64_t>() + b * width;
    const int64_t length = std::min(lengths.data_ptr<int64_t>()[b], width);
    const int64_t first = firsts.defined() ? std::max<int64_t>(firsts.data_ptr<int64_t>()[b], 0) : 0;
    const int64_t start = match_start(row, length, first, max_ngram, latest);
    int64_t* out = draft.data_ptr<int64_t>() + b * k;
    for (int64_t s = 0; s < k; ++s) out[s] = row[std::min(std::max<int64_t>(start, 0) + s, width - 1)];
    int64_t valid = start < 0 ? 0 : std::min(length - start, k);
    // An accepted EOS followed by more accepted drafts would run past the end of the text.
    for (int64_t s = 0; s < valid; ++s) {
      if (std::find(eos_token_ids.begin(), eos_token_ids.end(), out[s]) != eos_token_ids.end()) {
        valid = s;
        break;
      }
    }
    if (limits.defined() && limits.data_ptr<int64_t>()[b] - lengths.data_ptr<int64_t>()[b] <= 1) valid = 0;
    num_valid.data_ptr<int64_t>()[b] = valid;
  }
  return {draft, num_valid};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(genfn_kernels, m) {
  m.def("propose_prompt_lookup(Tensor tokens, Tensor cur_len, Tensor? first_column, Tensor? max_length, "
        "int[] eos_token_ids, int num_output_tokens, int max_matching_ngram_size, bool latest) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(genfn_kernels, CPU, m) { m.impl("propose_prompt_lookup", &propose_prompt_lookup); }
