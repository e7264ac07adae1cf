// Paged attention over one layer's cache, read slot by slot with an online softmax.
#pragma once

#include <cstdint>
#include <string>

#include "formats.h"

namespace tqx {

// A paged cache segment source: its format, tensors and block table [num_seqs, width].
struct PagedSource {
  const Format* format = nullptr;
  CacheView view;
  const int32_t* table = nullptr;
  int64_t width = 0;
};

struct AttentionStep {
  const Format* format;  // the layer's own cache
  int num_heads, kv_heads, head_size, block_size;
  float scale, softcap;
  int64_t window, recent_window, sink_tokens;
  PagedSource main, recent;  // recent: table null when the layer has no recent window
  const int64_t* seq_lens;   // widened to int64
  const int64_t* query_start;
  const int64_t* positions;
  int64_t num_seqs, num_tokens;
  const float* q;  // [T, H, D] fp32
  float* out;      // [T, H, D] fp32
};

// Runs the step with `parallel_for(total, fn)` spreading work items over threads.
template <typename ParallelFor>
void paged_attention(const AttentionStep& s, ParallelFor&& parallel_for);

}  // namespace tqx

#include "attention_impl.h"
