// A lossless greedy verify step's bookkeeping in one op: how many of each row's drafts equal the target's argmax
// before them, how many tokens the row appends (those drafts and the target's token after them), and its next
// drafts: the masks' predictions after what it appended, as many as the masks it fed when every draft passed, cut
// at the first whose top probability misses the draft threshold.  mars.decoding.engine's _check_drafts, _verify and
// _next_drafts compute the same with tensor ops (about 25 of them); this is their greedy, exact-threshold case.
//
// Why: a decode step streams every weight of the model through the caches, so the engine's code after the forward
// starts from memory and each small ATen op costs tens of microseconds (top_tokens.cpp); one op pays that once
// instead of 25 times, with the same results.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>

namespace {

// `t` checked (a CPU tensor of `dtype` with `rows` rows), contiguous (itself where it is already: no copy)
at::Tensor rows_of(const at::Tensor& t, const char* name, at::ScalarType dtype, int64_t rows) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype && t.dim() >= 1 && t.size(0) == rows,
              "mars::greedy_verify: ", name, " must be a CPU ", c10::toString(dtype), " tensor of ", rows, " rows");
  return t.contiguous();
}

}  // namespace

// predicted [rows, P] int64 (the argmax at each prediction column), top [rows, P] float32 (the top probability the
// draft threshold reads; read only when draft_threshold > 0), drafts [rows, D] int64 (what this step fed after
// the last real token), fed / draft_masks / draft_count / count [rows] int64 (drafts and masks fed, the drafts a row
// had, the count it would append without verifying), verifying [rows] bool.
// Returns (count, verified, next drafts [rows, D], next draft count), as the engine's tensor ops give them.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> greedy_verify(
    const at::Tensor& predicted, const c10::optional<at::Tensor>& top, const at::Tensor& drafts, const at::Tensor& fed,
    const at::Tensor& draft_masks, const at::Tensor& verifying, const at::Tensor& draft_count, const at::Tensor& count,
    double draft_threshold) {
  TORCH_CHECK(predicted.dim() == 2 && predicted.size(1) > 0, "mars::greedy_verify: predicted [rows, columns]");
  TORCH_CHECK(drafts.dim() == 2, "mars::greedy_verify: drafts [rows, slots]");
  const int64_t rows = predicted.size(0), P = predicted.size(1), D = drafts.size(1);
  const at::Tensor pred = rows_of(predicted, "predicted", at::kLong, rows);
  const at::Tensor drafted = rows_of(drafts, "drafts", at::kLong, rows);
  const at::Tensor n_fed = rows_of(fed, "fed", at::kLong, rows);
  const at::Tensor masks = rows_of(draft_masks, "draft_masks", at::kLong, rows);
  const at::Tensor had = rows_of(draft_count, "draft_count", at::kLong, rows);
  const at::Tensor counted = rows_of(count, "count", at::kLong, rows);
  const at::Tensor verifies = rows_of(verifying, "verifying", at::kBool, rows);
  const bool thresholded = draft_threshold > 0;
  at::Tensor tops;
  if (thresholded) {
    TORCH_CHECK(top.has_value(), "mars::greedy_verify: a draft threshold needs the top probabilities");
    tops = rows_of(*top, "top", at::kFloat, rows);
    TORCH_CHECK(tops.sizes() == predicted.sizes(), "mars::greedy_verify: top must be shaped like predicted");
  }
  at::Tensor out_count = at::empty({rows}, count.options());
  at::Tensor verified = at::empty({rows}, count.options());
  at::Tensor next = at::empty({rows, D}, drafts.options());
  at::Tensor next_count = at::empty({rows}, count.options());
  const int64_t* pr = pred.data_ptr<int64_t>();
  const float* tp = thresholded ? tops.data_ptr<float>() : nullptr;
  const int64_t* dr = drafted.data_ptr<int64_t>();
  const int64_t* fd = n_fed.data_ptr<int64_t>();
  const int64_t* dm = masks.data_ptr<int64_t>();
  const bool* vf = verifies.data_ptr<bool>();
  const int64_t* dc = had.data_ptr<int64_t>();
  const int64_t* ct = counted.data_ptr<int64_t>();
  int64_t* oc = out_count.data_ptr<int64_t>();
  int64_t* ov = verified.data_ptr<int64_t>();
  int64_t* nx = next.data_ptr<int64_t>();
  int64_t* nc = next_count.data_ptr<int64_t>();
  for (int64_t b = 0; b < rows; ++b) {
    const int64_t* p = pr + b * P;
    // drafts that pass: the leading ones equal to the argmax at the column before them, at most the row's own
    const int64_t limit = std::min({fd[b], D, P});
    int64_t passed = 0;
    while (passed < limit && dr[b * D + passed] == p[passed]) ++passed;
    const int64_t appended = passed + 1;  // and the target's token after them
    oc[b] = vf[b] ? appended : ct[b];
    ov[b] = vf[b] ? passed : 0;
    // the masks followed the right text only when every draft passed
    const bool all_passed = passed == fd[b] && dm[b] > 0;
    int64_t n = all_passed ? std::min(dm[b], D) : 0;
    int64_t sure = 0;  // the leading next drafts whose column meets the draft threshold
    for (int64_t j = 0; j < D; ++j) {
      const int64_t column = std::min(appended + j, P - 1);
      nx[b * D + j] = p[column];
      if (thresholded && sure == j && tp[b * P + column] >= draft_threshold) ++sure;
    }
    if (thresholded) n = std::min(sure, n);
    nc[b] = vf[b] ? n : dc[b];
  }
  return {out_count, verified, next, next_count};
}

TORCH_LIBRARY_FRAGMENT(mars, m) {
  m.def(
      "greedy_verify(Tensor predicted, Tensor? top, Tensor drafts, Tensor fed, Tensor draft_masks, Tensor verifying, "
      "Tensor draft_count, Tensor count, float draft_threshold) -> (Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(mars, CPU, m) { m.impl("greedy_verify", &greedy_verify); }
