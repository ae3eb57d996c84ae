// The scalar options of the attention ops in one struct: the dispatcher's arguments are folded into
// it once (attention_call.h), and everything after that passes the struct.
#pragma once

#include <c10/util/string_view.h>

#include <optional>

#include "scale_policy.h"

namespace entropy_attn {

// The scalar options of `attention` and `attention_sparsity`, as the schema names them.
struct AttentionOptions {
  bool causal = false;                 // is_causal, aligned top-left
  std::optional<double> scale_factor;  // the constant c of lambda = c g(n) / tau
  ScaleMode scale_mode = ScaleMode::kFixed;
  double temperature = 1.0;
  double log_base = 512.0;  // b of the "logn" policies
  bool enable_gqa = false;
  bool return_stats = true;  // false: the kernels compute output, lse and lambda only

  // From the schema's arguments (raises ValueError for a bad scale_mode).
  static AttentionOptions from_schema(bool is_causal, std::optional<double> scale_factor,
                                      c10::string_view scale_mode, double temperature,
                                      double log_base, bool enable_gqa, bool return_stats = true);
  // The schema's name of scale_mode.
  c10::string_view scale_mode_name() const;
};

}  // namespace entropy_attn
