// A paged KV cache (varlen_attention's block_table, the layout of varlen_attn and vLLM): key and
// value are pools of pages (num_pages, page_size, kv_heads, D), and sequence d's keys are the first
// seqused_k[d] tokens of the pages block_table[d, 0], block_table[d, 1], ... in that order.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/SymInt.h>

#include <optional>

namespace entropy_attn {

// The keys and values of a paged call as packed documents. Eager calls (whose table and seqused_k
// the checks read) take exactly the keys each sequence uses: in place on the CPU, whose kernels
// read the pool's tokens through key_rows (a pool whose pages and tokens merge into one dim),
// else gathered; traced ones (torch.compile, the Meta device) the op _gather_pages, whose
// sequences each get a slot of the first ceil(max_k / page_size) pages (as far as the table has
// columns), the keys past seqused_k included (seqused_k leaves them out), so that the shapes
// follow from max_k and the table, not from the values: one compiled graph for every table.
struct PagedKeys {
  // (keys, kv_heads, D / Dv); with key_rows the pool's tokens (num_pages x page_size, ...)
  at::Tensor key, value;
  at::Tensor cu_seq_k;                 // int32 (N + 1,): the sequences' keys (or slots)
  std::optional<at::Tensor> key_rows;  // int64: the token of each packed key, or none
};

// Checks the pages, the table, seqused_k (required), max_k and, when given, cu_seq_k (whose
// lengths, a paged call's slot lengths, must hold seqused_k), each error naming its argument, and
// gathers the pages each sequence uses (a copy: the kernels read packed keys): the op
// entropy_attn::_gather_pages, called through the dispatcher. With `in_place` the keys of an eager
// call on the CPU are left in the pool, named by key_rows.
PagedKeys gather_pages(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                       const at::Tensor& cu_seq_q, const std::optional<at::Tensor>& cu_seq_k,
                       const at::Tensor& block_table, const std::optional<at::Tensor>& seqused_k,
                       const c10::SymInt& max_k, bool in_place);

}  // namespace entropy_attn
