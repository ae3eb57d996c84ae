// The scalar options of the attention ops in one struct: the dispatcher's arguments are folded into
// it once (attention_call.h), and everything after that passes the struct.
#pragma once

#include <c10/core/SymInt.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/string_view.h>

#include <array>
#include <cstdint>
#include <optional>

#include "kernel_args.h"
#include "scale_policy.h"

namespace entropy_attn {

// The scalar options of `attention`, `attention_backward` and `attention_sparsity`, as the schemas
// name them (ops.cpp).
struct AttentionOptions {
  bool causal = false;                 // is_causal: window_right = 0
  std::optional<double> scale_factor;  // the constant c of lambda = c g(n) / tau
  ScaleMode scale_mode = ScaleMode::kFixed;
  double temperature = 1.0;
  double log_base = 512.0;  // b of the "logn" policies
  bool enable_gqa = false;
  bool return_stats = true;  // false: the kernels compute output, lse and lambda only
  int64_t window_left = -1, window_right = -1;  // window_size; -1 = unbounded
  bool bottom_right = false;                    // causal_alignment == "bottom_right"
  double softcap = 0.0;                         // 0: no logit softcapping
  double dropout_p = 0.0;                       // probability of dropping a weight
  c10::SymInt dropout_seed = 0;                 // the Philox key of the dropout mask (symbolic
                                                // while torch.compile traces a seed it draws)

  // From the schema's arguments (raises ValueError for a bad scale_mode or causal_alignment).
  static AttentionOptions from_schema(bool is_causal, std::optional<double> scale_factor,
                                      c10::string_view scale_mode, double temperature,
                                      double log_base, bool enable_gqa, bool return_stats,
                                      c10::IntArrayRef window_size,
                                      c10::string_view causal_alignment, double softcap,
                                      double dropout_p, c10::SymInt dropout_seed);
  // The schema's names of scale_mode and causal_alignment.
  c10::string_view scale_mode_name() const;
  c10::string_view causal_alignment_name() const;
  // window_size as the schema passes it.
  std::array<int64_t, 2> window_size() const { return {window_left, window_right}; }

  // The key pattern of a dense call: the window with causality folded in (right = 0).
  KeyPattern key_pattern() const {
    KeyPattern p;
    p.left = window_left;
    p.right = causal ? 0 : window_right;
    p.bottom_right = bottom_right;
    return p;
  }
  template <typename acc_t>
  Softcap<acc_t> logit_softcap() const {
    Softcap<acc_t> s;
    if (softcap > 0)
      s.cap = static_cast<acc_t>(softcap), s.inv_cap = static_cast<acc_t>(1 / softcap);
    return s;
  }
};

}  // namespace entropy_attn
