// Paged attention over one layer's cache: the step, its work items, and the merge of splits.
// Work items are (sequence, kv heads, block of queries, split of the keys): prefill items take
// one kv head, decode items every kv head (a token's slots lie side by side, so an item reads
// its split's blocks front to back). Each is run by the kernel compiled for this CPU
// (attention_kernel.cc, built once per instruction set).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <string>
#include <vector>

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

// Rows of an item: per kv head h0..h1-1, per query q0..q1-1, per query head of the group.
struct Item {
  int64_t seq, h0, h1, q0, q1, k0, k1, part;  // part: first row of its partial result, -1 = none
  int64_t rows(int groups) const { return (h1 - h0) * (q1 - q0) * groups; }
  // (query token, query head) of row r
  int64_t token(int64_t r, int groups) const { return q0 + r % ((q1 - q0) * groups) / groups; }
  int64_t head(int64_t r, int groups) const {
    const int64_t per_head = (q1 - q0) * groups;
    return (h0 + r / per_head) * groups + r % groups;
  }
};

// Runs one item: writes its rows to `out` (part < 0) or their softmax state (m, l, acc, accm
// per row) to `partial`.
using RunItem = void (*)(const AttentionStep&, const Item&, float* partial);

namespace avx512 { void run_item(const AttentionStep&, const Item&, float*); }
namespace avx2 { void run_item(const AttentionStep&, const Item&, float*); }
namespace base { void run_item(const AttentionStep&, const Item&, float*); }

struct Kernel {
  const char* name;
  RunItem run;
};

// The widest kernel this CPU runs (checked at run time: the library may meet any x86-64), no
// wider than TQEXPORT_NATIVE_ISA (avx2 or base; tests run the narrower kernels that way).
inline Kernel pick_kernel() {
  __builtin_cpu_init();
  const char* env = std::getenv("TQEXPORT_NATIVE_ISA");
  const std::string cap = env ? env : "";
  if (cap != "avx2" && cap != "base" && __builtin_cpu_supports("avx512f") &&
      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512dq"))
    return {"avx512", avx512::run_item};
  if (cap != "base" && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
    return {"avx2", avx2::run_item};
  return {"base", base::run_item};
}

namespace attn {
constexpr int64_t kQueryBlock = 16;
constexpr int64_t kSplitKeys = 512;  // keys per split in decode steps (one query per sequence)
constexpr int kMaxSplits = 16;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// finish a row: out = (acc + accm back in natural order and basis) / l, or zeros when the
// query saw nothing; acc sums the recent cache's values, accm the layer cache's in its basis
inline void finish_row(const AttentionStep& s, int64_t t, int64_t head, float l, float* acc,
                       float* accm) {
  const int d = s.head_size;
  float* o = s.out + (t * s.num_heads + head) * d;
  if (!(l > 0.0f)) {
    std::fill_n(o, d, 0.0f);
    return;
  }
  const Format& f = *s.format;
  float natural[gen::kMaxHeadSize];  // no allocation per row
  if (f.value_parts()) {
    from_parts(accm, natural, d);
    accm = natural;
  }
  if (f.value_rotated()) hadamard(accm, d);
  for (int i = 0; i < d; ++i) o[i] = (acc[i] + accm[i]) / l;
}
}  // namespace attn

// Runs the step: `parallel_for(total, fn)` spreads the items over the kernel's threads.
template <typename ParallelFor>
void paged_attention(const AttentionStep& s, RunItem run_item, ParallelFor&& parallel_for) {
  using namespace attn;
  const int d = s.head_size, groups = s.num_heads / s.kv_heads;
  std::fill_n(s.out, s.num_tokens * s.num_heads * d, 0.0f);
  int64_t longest = 0;
  for (int64_t q = 0; q < s.num_seqs; ++q)
    longest = std::max(longest, s.query_start[q + 1] - s.query_start[q]);
  std::vector<Item> items;
  int64_t parts = 0;  // rows of partial results
  for (int64_t q = 0; q < s.num_seqs; ++q) {
    const int64_t q0 = s.query_start[q], q1 = s.query_start[q + 1];
    if (q1 <= q0) continue;
    // keys the sequence's last query may see (no overflow at the largest position)
    const int64_t last = *std::max_element(s.positions + q0, s.positions + q1);
    const int64_t keys = std::max<int64_t>(0, std::min(s.seq_lens[q] - 1, last) + 1);
    int splits = 1;
    if (longest == 1 && keys > kSplitKeys)
      splits = static_cast<int>(std::min<int64_t>(kMaxSplits, (keys + kSplitKeys - 1) / kSplitKeys));
    const int64_t per = (keys + splits - 1) / splits;
    const int64_t heads_per_item = longest == 1 ? s.kv_heads : 1;
    for (int64_t h = 0; h < s.kv_heads; h += heads_per_item) {
      for (int64_t b = q0; b < q1; b += kQueryBlock) {
        const int64_t b1 = std::min(q1, b + kQueryBlock);
        Item it{q, h, h + heads_per_item, b, b1, 0, std::numeric_limits<int64_t>::max(), -1};
        if (splits == 1) {
          items.push_back(it);
          continue;
        }
        for (int k = 0; k < splits; ++k) {
          it.k0 = k * per;
          it.k1 = std::min(keys, (k + 1) * per);
          it.part = parts;
          parts += it.rows(groups);
          items.push_back(it);
        }
      }
    }
  }
  const size_t row_floats = 2 + size_t(d) * 2;  // m, l, acc [d], accm [d]
  std::vector<float> partial(size_t(parts) * row_floats);
  parallel_for(items.size(), [&](size_t i) {
    const Item& it = items[i];
    run_item(s, it, it.part < 0 ? nullptr : &partial[size_t(it.part) * row_floats]);
  });
  if (!parts) return;
  // merge the splits of each (sequence, kv heads): they are consecutive items
  std::vector<float> acc(d), accm(d);
  for (size_t i = 0; i < items.size();) {
    size_t j = i;
    while (j < items.size() && items[j].part >= 0 && items[j].seq == items[i].seq &&
           items[j].h0 == items[i].h0)
      ++j;
    if (j == i) {
      ++i;
      continue;
    }
    const Item& it = items[i];
    for (int64_t r = 0; r < it.rows(groups); ++r) {
      float m = kNegInf;
      for (size_t k = i; k < j; ++k)
        m = std::max(m, partial[size_t(items[k].part + r) * row_floats]);
      std::fill(acc.begin(), acc.end(), 0.0f);
      std::fill(accm.begin(), accm.end(), 0.0f);
      float l = 0.0f;
      if (m != kNegInf) {
        for (size_t k = i; k < j; ++k) {
          const float* p = &partial[size_t(items[k].part + r) * row_floats];
          if (p[0] == kNegInf) continue;
          const float c = std::exp(p[0] - m);
          l += p[1] * c;
          for (int e = 0; e < d; ++e) acc[e] += c * p[2 + e];
          for (int e = 0; e < d; ++e) accm[e] += c * p[2 + d + e];
        }
      }
      finish_row(s, it.token(r, groups), it.head(r, groups), l, acc.data(), accm.data());
    }
    i = j;
  }
}

}  // namespace tqx
