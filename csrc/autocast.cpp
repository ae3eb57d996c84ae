// Autocast (torch.autocast) for the attention ops, as for scaled_dot_product_attention, which is
// on autocast's lower-precision list: inside an autocast region, query and key (and value) that
// autocast may cast (floating point, not float64, on the region's device) run in the region's
// dtype (torch.get_autocast_dtype). Models mix them there: q and k rotated with float32 position
// tables next to a 16-bit v. The other tensors (mask, scale tensor, sinks) are read in any float
// dtype and keep theirs, so that an additive mask or a learned scale loses no precision.
// ATen's autocast header (the only declaration of the autocast dtype and cast) includes all of
// ATen, which the build's TORCH_ASSERT_ONLY_METHOD_OPERATORS forbids: this file alone lifts it
// (tests/test_build.py).
#undef TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/grad_mode.h>
#include <ATen/core/stack.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include "attention_call.h"
#include "attention_inputs.h"

namespace entropy_attn {
namespace {

// Where `attention`'s key_rows is given and its key would be cast: the rows it names gathered
// first, so that a cast copies the keys the call reads, not a whole pool of pages (a paged KV
// cache in float32 under a bfloat16 region: 97 ms for a 268 MB pool against 0.4 for the 256 keys
// used). The rows are checked first, with the op's own errors. A call that key_rows refuses (with
// an attn_mask, or inputs that autograd records: key_rows is inference-only) is left as it is, so
// that the op refuses it as outside autocast rather than running on the gathered keys.
template <c10::DeviceType kDevice>
void gather_rows_to_cast(const c10::OperatorHandle& op, torch::jit::Stack* stack, size_t first,
                         at::ScalarType dtype) {
  const std::optional<int> rows_index = op.schema().argumentIndexWithName("key_rows");
  if (!rows_index.has_value() || !(*stack)[first + *rows_index].isTensor()) return;
  const std::optional<int> mask_index = op.schema().argumentIndexWithName("attn_mask");
  if (mask_index.has_value() && !(*stack)[first + *mask_index].isNone()) return;
  for (size_t i = first; i < stack->size(); ++i) {
    const c10::IValue& arg = (*stack)[i];
    if (!arg.isTensor()) continue;
    const at::Tensor& t = arg.toTensor();
    if ((at::GradMode::is_enabled() && t.requires_grad()) || t._fw_grad(/*level=*/0).defined()) {
      return;
    }
  }
  const at::Tensor &query = (*stack)[first].toTensor(), &key = (*stack)[first + 1].toTensor(),
                   &value = (*stack)[first + 2].toTensor();
  if (!key.is_floating_point() || key.scalar_type() == at::kDouble || key.scalar_type() == dtype ||
      key.device().type() != kDevice || key.dim() != 4 || value.dim() != 4 ||
      value.size(2) != key.size(2)) {
    return;  // (not cast, or the op's checks report the key and value)
  }
  const at::Tensor rows = (*stack)[first + *rows_index].toTensor();
  const std::optional<int> cu_index = op.schema().argumentIndexWithName("cu_seq_q");
  check_key_rows(rows, key, cu_index.has_value() && !(*stack)[first + *cu_index].isNone(), query);
  at::Tensor gathered_key = gather_key_rows(key, rows),
             gathered_value = gather_key_rows(value, rows);
  (*stack)[first + 1] = std::move(gathered_key);
  (*stack)[first + 2] = std::move(gathered_value);
  (*stack)[first + *rows_index] = c10::IValue();
}

// Casts the op's first kTensors arguments (query, key[, value]) and calls the op again with this
// device's autocast key excluded (the next key then runs: autograd, or the device kernel).
template <c10::DeviceType kDevice, size_t kTensors>
void autocast_leading_tensors(const c10::OperatorHandle& op, c10::DispatchKeySet /*keys*/,
                              torch::jit::Stack* stack) {
  const size_t first = stack->size() - op.schema().arguments().size();
  const at::ScalarType dtype = at::autocast::get_autocast_dtype(kDevice);
  gather_rows_to_cast<kDevice>(op, stack, first, dtype);
  for (size_t i = first; i < first + kTensors; ++i) {
    c10::IValue& arg = (*stack)[i];
    if (arg.isTensor()) arg = at::autocast::cached_cast(dtype, arg.toTensor(), kDevice);
  }
  c10::impl::ExcludeDispatchKeyGuard no_autocast(
      at::autocast::get_autocast_dispatch_key_from_device_type(kDevice));
  op.callBoxed(stack);
}

template <c10::DeviceType kDevice>
void register_autocast(torch::Library& m) {
  m.impl("attention",
         torch::CppFunction::makeFromBoxedFunction<&autocast_leading_tensors<kDevice, 3>>());
  m.impl("attention_sparsity",
         torch::CppFunction::makeFromBoxedFunction<&autocast_leading_tensors<kDevice, 2>>());
}

}  // namespace

TORCH_LIBRARY_IMPL(entropy_attn, AutocastCPU, m) { register_autocast<c10::DeviceType::CPU>(m); }
TORCH_LIBRARY_IMPL(entropy_attn, AutocastCUDA, m) { register_autocast<c10::DeviceType::CUDA>(m); }

}  // namespace entropy_attn
