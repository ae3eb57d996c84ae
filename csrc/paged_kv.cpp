// varlen_attention's paged KV cache: checks, then the pages as packed documents.
//
// The CPU kernels read an eager call's keys in the pool, each packed key through key_rows (the
// token it is): decoding's few rows through row pointers, the rest converting them a block or a
// thread's keys at a time as they do 16-bit keys (csrc/cpu/attention_fwd.cpp). The
// CUDA kernels read keys at a fixed stride from one base (packed documents, attention_call.h), so
// there a paged call runs them on a copy of the keys its sequences use: O(keys x D), against the
// O(rows x keys x D) of the attention, and for decoding (one row per sequence) a second pass over
// the cache as large as the first, plus the copy's writes (README: Decoding over packed sequences
// and a paged KV cache).
#include "paged_kv.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/index.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/where.h>
#include <torch/library.h>

#include <cstdint>
#include <limits>
#include <tuple>

#include "attention_inputs.h"

namespace entropy_attn {
namespace {

void check_page_pool(const at::Tensor& key, const at::Tensor& value) {
  TORCH_CHECK_VALUE(key.dim() == 4,
                    "key must be a 4-D pool of pages (num_pages, page_size, kv_heads, head_dim) "
                    "with block_table, got ",
                    key.dim(), "-D of shape ", key.sym_sizes());
  TORCH_CHECK_VALUE(value.dim() == 4,
                    "value must be a 4-D pool of pages (num_pages, page_size, kv_heads, "
                    "v_head_dim) with block_table, got ",
                    value.dim(), "-D of shape ", value.sym_sizes());
  TORCH_CHECK_VALUE(value.sym_size(0) == key.sym_size(0) && value.sym_size(1) == key.sym_size(1),
                    "value must have key's pages (num_pages, page_size) = (", key.sym_size(0), ", ",
                    key.sym_size(1), "), got ", value.sym_sizes());
  TORCH_CHECK_VALUE(key.sym_size(1) >= 1, "key's pages must hold at least one token (page_size, ",
                    "dim 1), got ", key.sym_size(1));
}

// The values: each sequence's keys fit max_k, its slot in cu_seq_k (when given) and the table's
// columns, and the pages it uses are pages of the pool. (`table`: the columns a slot holds.)
void check_paged_values(const at::Tensor& table, const at::Tensor& seqused_k,
                        const std::optional<at::Tensor>& cu_seq_k, int64_t columns,
                        int64_t page_size, int64_t num_pages, int64_t max_k) {
  // (contiguous: a strided view's values are not at data + i)
  const at::Tensor used_t = seqused_k.to(at::kCPU).contiguous();
  const at::Tensor table_t = table.to(at::kCPU).contiguous();
  const int32_t* used = used_t.const_data_ptr<int32_t>();
  const int32_t* pages = table_t.const_data_ptr<int32_t>();
  const int64_t sequences = used_t.numel(), slot_columns = table_t.size(1);
  at::Tensor cu_t;
  const int32_t* cu = nullptr;
  if (cu_seq_k.has_value()) {
    cu_t = cu_seq_k->to(at::kCPU).contiguous();
    cu = cu_t.const_data_ptr<int32_t>();
    TORCH_CHECK_VALUE(cu[0] == 0, "cu_seq_k must start at 0, got ", cu[0]);
  }
  int64_t total = 0;
  for (int64_t d = 0; d < sequences; ++d) {
    const int64_t u = used[d];
    TORCH_CHECK_VALUE(u >= 0, "seqused_k[", d, "] = ", u, " must be >= 0");
    total += u;
    TORCH_CHECK_VALUE(u <= max_k, "max_k = ", max_k, " is smaller than sequence ", d,
                      " (seqused_k[", d, "] = ", u, ")");
    if (cu != nullptr) {
      // (in int64: the difference of two int32 offsets may not fit int32)
      const int64_t slot = static_cast<int64_t>(cu[d + 1]) - cu[d];
      TORCH_CHECK_VALUE(slot >= 0, "cu_seq_k must be non-decreasing, but cu_seq_k[", d + 1,
                        "] = ", cu[d + 1], " < cu_seq_k[", d, "] = ", cu[d]);
      TORCH_CHECK_VALUE(u <= slot, "seqused_k[", d, "] = ", u, " must be in [0, ", slot,
                        "] (that sequence's keys in cu_seq_k)");
    }
    const int64_t needed = (u + page_size - 1) / page_size;
    TORCH_CHECK_VALUE(needed <= columns, "seqused_k[", d, "] = ", u, " needs ", needed,
                      " pages of ", page_size, " tokens, but block_table has ", columns,
                      " columns");
    // (needed <= slot_columns: u <= max_k, and the slot holds the pages max_k needs)
    for (int64_t j = 0; j < needed && j < slot_columns; ++j) {
      const int64_t p = pages[d * slot_columns + j];
      TORCH_CHECK_VALUE(p >= 0 && p < num_pages, "block_table[", d, ", ", j, "] = ", p,
                        " is not a page of key (num_pages = ", num_pages, ")");
    }
  }
  // (the keys an eager call gathers, with int32 offsets: used_keys)
  TORCH_CHECK_VALUE(total <= std::numeric_limits<int32_t>::max(), "the paged keys of this call, ",
                    total, " used by ", sequences, " sequences (seqused_k), exceed int32 offsets");
}

using PagedTuple = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

// A checked paged call: each sequence's slot is the table's first `columns` columns, the pages
// max_k needs (as far as the table has them), of `slot` tokens.
struct PagedLayout {
  at::Tensor table;  // (N, columns), a view of block_table
  c10::SymInt sequences, columns, slot;
  bool values_checked;  // false on the Meta device and under fake tensors: no values to read
};

// Every check of a paged call (on the values where they can be read), each naming its argument.
PagedLayout check_paged_call(const at::Tensor& query, const at::Tensor& key,
                             const at::Tensor& value, const at::Tensor& cu_seq_q,
                             const std::optional<at::Tensor>& cu_seq_k,
                             const at::Tensor& block_table,
                             const std::optional<at::Tensor>& seqused_k, const c10::SymInt& max_k) {
  TORCH_CHECK_TYPE(block_table.defined(), "block_table must be an int32 tensor or None");
  TORCH_CHECK_TYPE(block_table.scalar_type() == at::kInt, "block_table must be int32, got ",
                   block_table.scalar_type());
  TORCH_CHECK_VALUE(block_table.dim() == 2,
                    "block_table must be 2-D (number of sequences, pages per sequence), got shape ",
                    block_table.sym_sizes());
  TORCH_CHECK_VALUE(block_table.device() == query.device(),
                    "block_table must be on query's device (", query.device(), "), got ",
                    block_table.device());
  check_page_pool(key, value);
  check_offsets(cu_seq_q, "cu_seq_q", query);
  const c10::SymInt sequences = cu_seq_q.sym_size(0) - 1;
  TORCH_CHECK_VALUE(block_table.sym_size(0) == sequences,
                    "block_table must have a row per sequence (", sequences, "), got shape ",
                    block_table.sym_sizes());
  TORCH_CHECK_VALUE(seqused_k.has_value(),
                    "block_table needs seqused_k (int32, the number of keys of each sequence, in "
                    "its pages), as varlen_attn");
  check_seqused_k(*seqused_k, sequences, query);
  if (cu_seq_k.has_value()) {
    check_offsets(*cu_seq_k, "cu_seq_k", query);
    TORCH_CHECK_VALUE(cu_seq_k->sym_size(0) == sequences + 1,
                      "cu_seq_q and cu_seq_k must have the same length, got ", sequences + 1,
                      " and ", cu_seq_k->sym_size(0));
  }
  TORCH_CHECK_VALUE(max_k >= 0, "max_k must be >= 0, got ", max_k);
  const c10::SymInt& page_size = key.sym_size(1);
  // Each sequence's slot: the pages max_k needs, as far as the table has columns (a table sized
  // for the longest context a server admits is not copied whole).
  // (ceil without max_k + page_size - 1, which overflows int64 for a max_k near 2^63)
  const c10::SymInt slot_pages = max_k == 0 ? c10::SymInt(0) : (max_k - 1) / page_size + 1;
  const at::Tensor table = block_table.slice_symint(1, 0, slot_pages);
  const c10::SymInt columns = table.sym_size(1), slot = columns * page_size;
  const bool readable = !query.is_meta() && values_readable(table) && values_readable(*seqused_k);
  if (readable) {
    check_paged_values(table, *seqused_k, cu_seq_k, block_table.size(1), page_size.expect_int(),
                       key.size(0), max_k.expect_int());
  }
  return {table, sequences, columns, slot, readable};
}
// The slots gathered whole: sizes from the shapes and max_k alone, as torch.compile needs them (one
// graph for every table); memory and time N x slot, whatever seqused_k holds.
PagedTuple gather_slots(const PagedLayout& l, const at::Tensor& key, const at::Tensor& value,
                        const at::Tensor& seqused_k) {
  const c10::SymInt& page_size = key.sym_size(1);
  const at::Tensor& table = l.table;
  // Entries past the pages a sequence uses may hold anything (-1, stale pages): page 0 stands in,
  // its keys past seqused_k, which leaves them out.
  const at::Tensor first_keys = at::arange(c10::Scalar(l.columns), table.options().dtype(at::kLong))
                                    .mul(c10::Scalar(page_size));
  const at::Tensor used = first_keys.unsqueeze(0) < seqused_k.unsqueeze(1);
  const at::Tensor pages = at::where(used, table, 0).flatten();
  auto gather = [&](const at::Tensor& pool) {
    // (an empty pool has no page 0; every sequence then has 0 keys: checked above)
    if (pool.sym_size(0) == 0) {
      return pool.new_zeros_symint({l.sequences * l.slot, pool.sym_size(2), pool.sym_size(3)});
    }
    return pool.index_select(0, pages).flatten(0, 1);
  };
  return {gather(key), gather(value),
          at::arange(c10::Scalar(l.sequences + 1), table.options()).mul(c10::Scalar(l.slot))};
}

// Whether a pool's pages and tokens merge into one dim (a view: flatten(0, 1) copies nothing).
bool tokens_merge(const at::Tensor& pool) {
  return pool.stride(0) == pool.size(1) * pool.stride(1);
}

// Rows `token` of a pool of pages (num_pages, page_size, heads, dim) seen as (num_pages x
// page_size) tokens: index_select over the tokens copies each token's (heads, dim) block whole
// where the pool's pages and tokens merge into one dimension (a contiguous pool), where advanced
// indexing by (page, row) pairs computes every element's offset (25 MB of bfloat16 keys: 1.8 ms
// against 6.3). Larger copies are bound by the page faults of their fresh output either way (49
// MB of float32: 3.5 ms into memory already mapped, 19-22 ms into a new tensor). A pool whose
// pages and tokens do not merge (a strided view) is indexed by the pairs.
at::Tensor gather_tokens(const at::Tensor& pool, const at::Tensor& token) {
  const int64_t page_size = pool.size(1);
  if (tokens_merge(pool)) return pool.flatten(0, 1).index_select(0, token);
  const c10::List<std::optional<at::Tensor>> index(
      {token.div(page_size, "floor"), token.remainder(page_size)});
  return at::index(pool, index);
}

// The keys each sequence uses, exactly (sum of seqused_k tokens), where the values are read anyway
// (eager calls): a batch of short sequences with one long one reads its keys, not N slots as long
// as the longest. Token j of sequence d is row j % page_size of page table[d, j / page_size]. Left
// in the pool with their tokens as key_rows (in_place), else gathered.
PagedKeys used_keys(const PagedLayout& l, const at::Tensor& key, const at::Tensor& value,
                    const at::Tensor& seqused_k, bool in_place) {
  const at::Tensor used_t = seqused_k.to(at::kCPU).contiguous();
  const at::Tensor table_t = l.table.to(at::kCPU).contiguous();
  const int32_t* used = used_t.const_data_ptr<int32_t>();
  const int32_t* pages = table_t.const_data_ptr<int32_t>();
  const int64_t sequences = used_t.numel(), columns = table_t.size(1), page_size = key.size(1);
  at::Tensor cu = at::empty({sequences + 1}, at::kInt);
  int32_t* offsets = cu.mutable_data_ptr<int32_t>();
  offsets[0] = 0;  // (the sum fits int32: check_paged_values)
  for (int64_t d = 0; d < sequences; ++d) offsets[d + 1] = offsets[d] + used[d];
  // Token j of sequence d is pool row table[d, j / page_size] * page_size + j % page_size.
  at::Tensor token = at::empty({offsets[sequences]}, at::kLong);
  int64_t* t = token.mutable_data_ptr<int64_t>();
  for (int64_t d = 0; d < sequences; ++d) {
    for (int64_t j = 0; j < used[d]; ++j)
      *t++ = pages[d * columns + j / page_size] * page_size + j % page_size;
  }
  token = token.to(key.device());
  if (in_place && tokens_merge(key) && tokens_merge(value)) {
    return {key.flatten(0, 1), value.flatten(0, 1), cu.to(key.device()), token};
  }
  return {gather_tokens(key, token), gather_tokens(value, token), cu.to(key.device()),
          std::nullopt};
}

// The kernel of _gather_pages on every device (CompositeExplicitAutograd): on the Meta device and
// under fake tensors it checks what the shapes tell and gives the outputs' shapes.
PagedTuple gather_pages_kernel(const at::Tensor& query, const at::Tensor& key,
                               const at::Tensor& value, const at::Tensor& cu_seq_q,
                               const std::optional<at::Tensor>& cu_seq_k,
                               const at::Tensor& block_table,
                               const std::optional<at::Tensor>& seqused_k, c10::SymInt max_k) {
  const PagedLayout l =
      check_paged_call(query, key, value, cu_seq_q, cu_seq_k, block_table, seqused_k, max_k);
  // (only the slots gathered whole need this: an eager call of the op's wrapper takes the keys
  // used, whose count check_paged_values bounds, however large max_k and the table are)
  TORCH_CHECK_VALUE(l.sequences * l.slot <= std::numeric_limits<int32_t>::max(),
                    "the paged keys of this call, ", l.sequences, " sequences of ", l.columns,
                    " pages of ", key.sym_size(1), " tokens, exceed int32 offsets");
  return gather_slots(l, key, value, *seqused_k);
}

}  // namespace

PagedKeys gather_pages(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                       const at::Tensor& cu_seq_q, const std::optional<at::Tensor>& cu_seq_k,
                       const at::Tensor& block_table, const std::optional<at::Tensor>& seqused_k,
                       const c10::SymInt& max_k, bool in_place) {
  // Eager calls take exactly the keys used (their values are read by the checks in any case): in
  // place where the kernels read them so, the CPU's (the CUDA kernels get key_rows' rows gathered,
  // attention_kernel, after one more check of them on the host); traced ones the op, whose slots
  // have sizes from the shapes, and whose checks run with the graph.
  const PagedLayout l =
      check_paged_call(query, key, value, cu_seq_q, cu_seq_k, block_table, seqused_k, max_k);
  if (l.values_checked) return used_keys(l, key, value, *seqused_k, in_place && key.is_cpu());
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("entropy_attn::_gather_pages", "")
          .typed<PagedTuple(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const at::Tensor&, const std::optional<at::Tensor>&, const at::Tensor&,
                            const std::optional<at::Tensor>&, c10::SymInt)>();
  auto [k, v, cu_k] = op.call(query, key, value, cu_seq_q, cu_seq_k, block_table, seqused_k, max_k);
  return {std::move(k), std::move(v), std::move(cu_k), std::nullopt};
}

TORCH_LIBRARY_IMPL(entropy_attn, CompositeExplicitAutograd, m) {
  m.impl("_gather_pages", &gather_pages_kernel);
}

}  // namespace entropy_attn
