// Paged attention: work items are (sequence, kv head, block of queries, split of the keys).
// Each item reads every slot it needs once, straight from the paged blocks, decodes it into a
// small tile, and keeps an online softmax per query row; splits are merged afterwards.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "decode.h"

namespace tqx {
namespace attn {

constexpr int kKeyTile = 32;
constexpr int64_t kQueryBlock = 16;
constexpr int64_t kSplitKeys = 512;  // keys per split in decode steps (one query per sequence)
constexpr int kMaxSplits = 16;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct Item {
  int64_t seq, head, q0, q1, k0, k1, part;  // part: index of its partial result, -1 = none
};

enum class Kind { Main, Recent, Sink };

// Per-row softmax state of one item: running max, sum, and the weighted value sums (plain,
// and in the rotated basis for MSE values of the main cache).
struct Rows {
  int n, d;
  std::vector<float> q, qrot, m, l, acc, accr;
  Rows(int n_, int d_, bool rot_k, bool rot_v)
      : n(n_), d(d_), q(size_t(n_) * d_), qrot(rot_k ? size_t(n_) * d_ : 0),
        m(n_, kNegInf), l(n_, 0.0f), acc(size_t(n_) * d_, 0.0f),
        accr(rot_v ? size_t(n_) * d_ : 0, 0.0f) {}
};

inline float dot(const float* a, const float* b, int d) {
  float s = 0.0f;
  for (int i = 0; i < d; ++i) s += a[i] * b[i];
  return s;
}

inline void axpy(float* y, float a, const float* x, int d) {
  for (int i = 0; i < d; ++i) y[i] += a * x[i];
}

inline void scale_row(float* y, float a, int d) {
  for (int i = 0; i < d; ++i) y[i] *= a;
}

#if defined(TQX_NO_CLONES)
#define TQX_CLONES
#else
#define TQX_CLONES __attribute__((target_clones("arch=skylake-avx512", "arch=haswell", "default")))
#endif

// One segment's keys [lo, hi] for the rows of an item.
TQX_CLONES
static void run_segment(const AttentionStep& s, const Item& it, Kind kind, int64_t lo, int64_t hi,
                        const int64_t* pos, Rows& rows) {
  const PagedSource& src = kind == Kind::Main ? s.main : s.recent;
  const Format& fmt = *src.format;
  const int d = s.head_size, groups = s.num_heads / s.kv_heads;
  const bool rot_k = kind == Kind::Main && fmt.key_rotated();
  const bool rot_v = kind == Kind::Main && fmt.value_rotated();
  float kt[kKeyTile * 128];  // kKeyTile keys of up to 128 elements; larger heads: heap
  std::vector<float> big;
  float* ktile = kt;
  if (d > 128) {
    big.resize(size_t(kKeyTile) * d);
    ktile = big.data();
  }
  std::vector<float> vbuf(d);
  float kmul[kKeyTile];
  int64_t th[kKeyTile];
  bool real[kKeyTile];
  std::vector<float> probs(size_t(rows.n) * kKeyTile);
  std::vector<uint8_t> seen(size_t(rows.n) * kKeyTile);
  const int32_t* table = src.table + it.seq * src.width;
  const int64_t seq_len = s.seq_lens[it.seq];
  for (int64_t p0 = lo; p0 <= hi; p0 += kKeyTile) {
    const int nk = static_cast<int>(std::min<int64_t>(kKeyTile, hi - p0 + 1));
    bool any_real = false;
    for (int j = 0; j < nk; ++j) {
      const int64_t p = p0 + j, col = p / s.block_size;
      const int32_t block = col < src.width ? table[col] : 0;
      real[j] = block != 0 && p < seq_len;
      if (!real[j]) continue;
      any_real = true;
      th[j] = ((int64_t(block) * s.block_size + p % s.block_size) * s.kv_heads) + it.head;
      kmul[j] = decode_key(fmt, src.view, th[j], ktile + size_t(j) * d);
    }
    if (!any_real) continue;
    bool used[kKeyTile] = {};
    for (int r = 0; r < rows.n; ++r) {
      const int64_t P = pos[r / groups];
      const float* q = rot_k ? &rows.qrot[size_t(r) * d] : &rows.q[size_t(r) * d];
      float* pr = &probs[size_t(r) * kKeyTile];
      uint8_t* sn = &seen[size_t(r) * kKeyTile];
      float mt = kNegInf;
      for (int j = 0; j < nk; ++j) {
        const int64_t p = p0 + j;
        bool ok = real[j] && p <= P && (s.window == 0 || p > P - s.window);
        if (kind == Kind::Main)
          ok = ok && p >= s.sink_tokens && (s.recent_window == 0 || p <= P - s.recent_window);
        else if (kind == Kind::Recent)
          ok = ok && p >= s.sink_tokens && p > P - s.recent_window;
        else
          ok = ok && p < s.sink_tokens;
        sn[j] = ok;
        if (!ok) continue;
        float sc = dot(q, ktile + size_t(j) * d, d) * kmul[j] * s.scale;
        if (s.softcap != 0.0f) sc = std::tanh(sc / s.softcap) * s.softcap;
        mt = std::max(mt, sc);
        pr[j] = sc;
        used[j] = true;
      }
      if (mt == kNegInf) continue;  // sees no key of this tile
      const float m_new = std::max(rows.m[r], mt);
      const float corr = rows.m[r] == kNegInf ? 0.0f : std::exp(rows.m[r] - m_new);
      if (corr != 1.0f) {
        scale_row(&rows.acc[size_t(r) * d], corr, d);
        if (!rows.accr.empty()) scale_row(&rows.accr[size_t(r) * d], corr, d);
      }
      float sum = 0.0f;
      for (int j = 0; j < nk; ++j) {
        if (!sn[j]) continue;
        pr[j] = std::exp(pr[j] - m_new);
        sum += pr[j];
      }
      rows.l[r] = rows.l[r] * corr + sum;
      rows.m[r] = m_new;
    }
    for (int j = 0; j < nk; ++j) {
      if (!used[j]) continue;
      decode_value(fmt, src.view, th[j], vbuf.data());
      for (int r = 0; r < rows.n; ++r) {
        if (!seen[size_t(r) * kKeyTile + j]) continue;
        float* acc = rot_v ? &rows.accr[size_t(r) * d] : &rows.acc[size_t(r) * d];
        axpy(acc, probs[size_t(r) * kKeyTile + j], vbuf.data(), d);
      }
    }
  }
}

// Key ranges [lo, hi] of each segment for queries at positions [pmin, pmax] of one sequence.
struct Ranges {
  int64_t lo[3], hi[3];
};

inline Ranges segment_ranges(const AttentionStep& s, int64_t seq_len, int64_t pmin,
                             int64_t pmax) {
  Ranges r;
  const int64_t last = std::min(seq_len - 1, pmax);
  const int64_t wlo = s.window ? std::max<int64_t>(0, pmin - s.window + 1) : 0;
  r.lo[0] = std::max(wlo, s.recent_window ? s.sink_tokens : int64_t(0));
  r.hi[0] = s.recent_window ? std::min(last, pmax - s.recent_window) : last;
  if (s.recent_window) {
    r.lo[1] = std::max({wlo, s.sink_tokens, pmin - s.recent_window + 1});
    r.hi[1] = last;
  } else {
    r.lo[1] = 0, r.hi[1] = -1;
  }
  r.lo[2] = wlo;
  r.hi[2] = s.sink_tokens ? std::min(last, s.sink_tokens - 1) : -1;
  return r;
}

inline void prepare_rows(const AttentionStep& s, const Item& it, Rows& rows) {
  const int d = s.head_size, groups = s.num_heads / s.kv_heads;
  for (int r = 0; r < rows.n; ++r) {
    const int64_t t = it.q0 + r / groups, head = it.head * groups + r % groups;
    std::copy_n(s.q + (t * s.num_heads + head) * d, d, &rows.q[size_t(r) * d]);
    if (!rows.qrot.empty()) {
      std::copy_n(&rows.q[size_t(r) * d], d, &rows.qrot[size_t(r) * d]);
      hadamard(&rows.qrot[size_t(r) * d], d);
    }
  }
}

inline void finish_row(const AttentionStep& s, int64_t t, int64_t head, float l, float* acc,
                       float* accr) {
  const int d = s.head_size;
  float* o = s.out + (t * s.num_heads + head) * d;
  if (!(l > 0.0f)) {
    std::fill_n(o, d, 0.0f);
    return;
  }
  if (accr) {
    hadamard(accr, d);
    for (int i = 0; i < d; ++i) acc[i] += accr[i];
  }
  for (int i = 0; i < d; ++i) o[i] = acc[i] / l;
}

}  // namespace attn

template <typename ParallelFor>
void paged_attention(const AttentionStep& s, ParallelFor&& parallel_for) {
  using namespace attn;
  const int d = s.head_size, groups = s.num_heads / s.kv_heads;
  const bool rot_k = s.format->key_rotated(), rot_v = s.format->value_rotated();
  std::fill_n(s.out, s.num_tokens * s.num_heads * d, 0.0f);
  int64_t longest = 0;
  for (int64_t q = 0; q < s.num_seqs; ++q)
    longest = std::max(longest, s.query_start[q + 1] - s.query_start[q]);
  std::vector<Item> items;
  int64_t parts = 0;
  for (int64_t q = 0; q < s.num_seqs; ++q) {
    const int64_t q0 = s.query_start[q], q1 = s.query_start[q + 1];
    if (q1 <= q0) continue;
    // keys the sequence's last query may see (no overflow at the largest position)
    const int64_t keys =
        std::min(s.seq_lens[q] - 1, *std::max_element(s.positions + q0, s.positions + q1)) + 1;
    int splits = 1;
    if (longest == 1 && keys > kSplitKeys)
      splits = static_cast<int>(std::min<int64_t>(kMaxSplits, (keys + kSplitKeys - 1) / kSplitKeys));
    const int64_t per = splits > 1 ? (keys + splits - 1) / splits : std::max<int64_t>(keys, 1);
    for (int64_t h = 0; h < s.kv_heads; ++h) {
      for (int64_t b = q0; b < q1; b += kQueryBlock) {
        const int64_t b1 = std::min(q1, b + kQueryBlock);
        for (int k = 0; k < splits; ++k) {
          const int64_t k0 = k * per, k1 = std::min(keys, (k + 1) * per);
          items.push_back({q, h, b, b1, k0, splits == 1 ? std::numeric_limits<int64_t>::max() : k1,
                           splits == 1 ? -1 : parts++});
        }
      }
    }
  }
  // partial results: per row m, l, acc [d], accr [d]
  const size_t row_floats = 2 + size_t(d) * 2;
  std::vector<float> partial(size_t(parts) * groups * row_floats);
  auto run = [&](size_t i) {
    const Item& it = items[i];
    const int n = static_cast<int>((it.q1 - it.q0) * groups);
    Rows rows(n, d, rot_k, rot_v);
    prepare_rows(s, it, rows);
    std::vector<int64_t> pos(it.q1 - it.q0);
    for (int64_t t = it.q0; t < it.q1; ++t) pos[t - it.q0] = s.positions[t];
    const int64_t pmin = *std::min_element(pos.begin(), pos.end());
    const int64_t pmax = *std::max_element(pos.begin(), pos.end());
    const Ranges rg = segment_ranges(s, s.seq_lens[it.seq], pmin, pmax);
    const Kind kinds[3] = {Kind::Main, Kind::Recent, Kind::Sink};
    for (int g = 0; g < 3; ++g) {
      if (g > 0 && !s.recent.table) break;
      const int64_t lo = std::max(rg.lo[g], it.k0), hi = std::min(rg.hi[g], it.k1 - 1);
      if (lo <= hi) run_segment(s, it, kinds[g], lo, hi, pos.data(), rows);
    }
    if (it.part < 0) {
      for (int r = 0; r < n; ++r)
        finish_row(s, it.q0 + r / groups, it.head * groups + r % groups, rows.l[r],
                   &rows.acc[size_t(r) * d], rot_v ? &rows.accr[size_t(r) * d] : nullptr);
      return;
    }
    float* out = &partial[size_t(it.part) * groups * row_floats];
    for (int r = 0; r < n; ++r, out += row_floats) {
      out[0] = rows.m[r];
      out[1] = rows.l[r];
      std::copy_n(&rows.acc[size_t(r) * d], d, out + 2);
      if (rot_v) std::copy_n(&rows.accr[size_t(r) * d], d, out + 2 + d);
    }
  };
  parallel_for(items.size(), run);
  if (!parts) return;
  // merge the splits of each (sequence, kv head): items of one split group are consecutive
  std::vector<float> acc(d), accr(d);
  for (size_t i = 0; i < items.size();) {
    size_t j = i;
    while (j < items.size() && items[j].part >= 0 && items[j].seq == items[i].seq &&
           items[j].head == items[i].head && items[j].q0 == items[i].q0)
      ++j;
    if (j == i) {
      ++i;
      continue;
    }
    const Item& it = items[i];
    for (int r = 0; r < groups; ++r) {
      float m = kNegInf;
      for (size_t k = i; k < j; ++k)
        m = std::max(m, partial[(size_t(items[k].part) * groups + r) * row_floats]);
      std::fill(acc.begin(), acc.end(), 0.0f);
      std::fill(accr.begin(), accr.end(), 0.0f);
      float l = 0.0f;
      if (m != kNegInf) {
        for (size_t k = i; k < j; ++k) {
          const float* p = &partial[(size_t(items[k].part) * groups + r) * row_floats];
          if (p[0] == kNegInf) continue;
          const float c = std::exp(p[0] - m);
          l += p[1] * c;
          axpy(acc.data(), c, p + 2, d);
          if (rot_v) axpy(accr.data(), c, p + 2 + d, d);
        }
      }
      finish_row(s, it.q0, it.head * groups + r, l, acc.data(), rot_v ? accr.data() : nullptr);
    }
    i = j;
  }
}

}  // namespace tqx
