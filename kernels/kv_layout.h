// Layout of the paged KV pool in memory, shared by kvcache/ (which hands out page ids),
// the CPU engine and the CUDA kernels (which read and write the pages).
//
// Per layer there is one K buffer and one V buffer, each
//   [num_pages][num_kv_heads][page_size][head_dim]   (HND inside a page)
// so one KV head's tile of a page is page_size * head_dim contiguous elements: a single
// coalesced (or bulk-async) load per (page, head). With tensor parallelism each rank holds
// its own heads' share of every page (num_kv_heads = that rank's heads).
//
// An FP8 pool (--kv-cache-dtype fp8, CUDA backend) holds e4m3 bytes in the same layout
// (dtype_bytes 1) and, beside each buffer, one float32 scale per (page, kv head, slot): the
// row's K (or V) is quantized per token and head by models/fp8.h's KV rule (fp8_kv_scale: amax /
// 448 rounded up to a power of two; q = e4m3(x / scale)). Scale index = element offset /
// head_dim.
#pragma once

#include <cstdint>

namespace treeserve {

struct KvLayout {
  int32_t num_layers = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  int32_t page_size = 16;
  int64_t num_pages = 0;
  int32_t dtype_bytes = 2;  // 4 = fp32 (CPU backend), 2 = fp16/bf16, 1 = e4m3 (CUDA backend)
  int32_t scale_bytes = 0;  // per (token, kv head) row of K or V: 4 with e4m3, else 0

  // The pool's element type: value_bytes a value, or e4m3 (one byte a value and a float32
  // scale a row) where e4m3 is set.
  void set_element(int32_t value_bytes, bool e4m3) {
    dtype_bytes = e4m3 ? 1 : value_bytes;
    scale_bytes = e4m3 ? 4 : 0;
  }
  // Elements of one page of one K (or V) buffer.
  int64_t page_elems() const { return int64_t(num_kv_heads) * page_size * head_dim; }
  // Bytes of one layer's K (or V) buffer, and of its scales (0 without).
  int64_t layer_bytes() const { return layer_elems() * dtype_bytes; }
  int64_t layer_scale_bytes() const {
    return int64_t(num_pages) * num_kv_heads * page_size * scale_bytes;
  }
  // Elements of one layer's K (or V) buffer.
  int64_t layer_elems() const { return page_elems() * num_pages; }
  // Offset of (page, head, slot, 0) inside one layer's K or V buffer.
  int64_t offset(int64_t page, int32_t head, int32_t slot) const {
    return page * page_elems() + (int64_t(head) * page_size + slot) * head_dim;
  }
  // Bytes of KV one token occupies across all layers (K and V).
  int64_t bytes_per_token() const {
    return int64_t(num_layers) * 2 * num_kv_heads * (int64_t(head_dim) * dtype_bytes + scale_bytes);
  }
  // Pages a byte budget holds.
  static int64_t pages_for_budget(int64_t budget_bytes, int64_t bytes_per_token,
                                  int32_t page_size) {
    return budget_bytes / (bytes_per_token * page_size);
  }
};

}  // namespace treeserve
