// Read access to the CPU backend's float32 KV pool, for tests that check what a step wrote
// there (e.g. that an FP8 KV cache holds e4m3 values times one scale per row).
#pragma once

#include <cstdint>
#include <span>

namespace treeserve {

class Backend;

// One layer's K buffer (v false) or V buffer of a backend made by create_cpu_backend or
// create_cpu_backend_random: [num_pages][num_kv_heads][page_size][head_dim] as its
// kv_layout() describes, valid until the backend's next forward. Empty for another backend
// or a layer out of range.
std::span<const float> cpu_backend_kv_buffer(const Backend& backend, int32_t layer, bool v);

}  // namespace treeserve
