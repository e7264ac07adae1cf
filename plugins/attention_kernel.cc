// The attention work item, compiled once per instruction set (TQX_ISA names the namespace:
// avx512, avx2 or base; the build passes the matching -march). Each item reads every slot it
// needs once, straight from the paged blocks, decodes it into a small tile, and keeps an
// online softmax per query row.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "attention.h"
#include "decode.h"

#ifndef TQX_ISA
#define TQX_ISA base
#endif

namespace tqx {
namespace TQX_ISA {
namespace {

using attn::kNegInf;
constexpr int kKeyTile = 32;

enum class Kind { Main, Recent, Sink };

// e^x for x <= 0 within 2 ulp (Cody-Waite reduction, degree-6 polynomial), written without
// branches so the tile loop vectorizes; x below -87 gives 0.
inline float exp_neg(float x) {
  x = std::max(x, -87.0f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  uint32_t bits;  // p * 2^n: n added to the exponent field (unsigned: wraps, never UB)
  std::memcpy(&bits, &p, 4);
  bits += static_cast<uint32_t>(static_cast<int32_t>(n)) << 23;
  std::memcpy(&p, &bits, 4);
  return x <= -87.0f ? 0.0f : p;
}

inline float dot(const float* a, const float* b, int d) {
  float s = 0.0f;
  for (int i = 0; i < d; ++i) s += a[i] * b[i];
  return s;
}

inline void axpy(float* __restrict y, float a, const float* __restrict x, int d) {
  for (int i = 0; i < d; ++i) y[i] += a * x[i];
}

// Per-row softmax state of one item: running max, sum, and the weighted value sums: of the
// recent cache (natural order) and of the layer's cache (in its basis and order, see
// attn::finish_row); queries as the recent cache and the layer's cache read them.
struct Rows {
  int n, d;
  std::vector<float> q, qm, m, l, acc, accm;
  Rows(int n_, int d_)
      : n(n_), d(d_), q(size_t(n_) * d_), qm(size_t(n_) * d_), m(n_, kNegInf), l(n_, 0.0f),
        acc(size_t(n_) * d_, 0.0f), accm(size_t(n_) * d_, 0.0f) {}
};

struct Scratch {
  std::vector<float> keys, value, scores;
  std::vector<uint8_t> seen;
  Scratch(int rows, int d)
      : keys(size_t(kKeyTile) * d), value(d), scores(size_t(rows) * kKeyTile),
        seen(size_t(rows) * kKeyTile) {}
};

// One segment's keys [lo, hi] for the rows of an item, format M.
template <Mode M>
void run_segment(const AttentionStep& s, const Item& it, Kind kind, int64_t lo, int64_t hi,
                 const int64_t* pos, Rows& rows, Scratch& sc) {
  const PagedSource& src = kind == Kind::Main ? s.main : s.recent;
  const Format& fmt = *src.format;
  const int d = s.head_size, groups = s.num_heads / s.kv_heads;
  const bool main = kind == Kind::Main;
  float* ktile = sc.keys.data();
  float kmul[kKeyTile];
  int64_t th[kKeyTile];
  bool real[kKeyTile];
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
      kmul[j] = decode_key<M>(fmt, src.view, th[j], ktile + size_t(j) * d) * s.scale;
    }
    if (!any_real) continue;
    bool used[kKeyTile] = {};
    for (int r = 0; r < rows.n; ++r) {
      const int64_t P = pos[r / groups];
      const float* q = main ? &rows.qm[size_t(r) * d] : &rows.q[size_t(r) * d];
      float* pr = &sc.scores[size_t(r) * kKeyTile];
      uint8_t* sn = &sc.seen[size_t(r) * kKeyTile];
      bool any = false;
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
        pr[j] = kNegInf;
        any = any || ok;
      }
      if (!any) continue;
      float mt = kNegInf;
      for (int j = 0; j < nk; ++j) {
        if (!sn[j]) continue;
        float v = dot(q, ktile + size_t(j) * d, d) * kmul[j];
        if (s.softcap != 0.0f) v = std::tanh(v / s.softcap) * s.softcap;
        pr[j] = v;
        mt = std::max(mt, v);
        used[j] = true;
      }
      const float m_new = std::max(rows.m[r], mt);
      const float corr = rows.m[r] == kNegInf ? 0.0f : exp_neg(rows.m[r] - m_new);
      if (corr != 1.0f) {
        float* acc = &rows.acc[size_t(r) * d];
        float* accm = &rows.accm[size_t(r) * d];
        for (int i = 0; i < d; ++i) acc[i] *= corr;
        for (int i = 0; i < d; ++i) accm[i] *= corr;
      }
      float sum = 0.0f;
      for (int j = 0; j < nk; ++j) {
        const float e = exp_neg(pr[j] - m_new);
        pr[j] = sn[j] ? e : 0.0f;
        sum += pr[j];
      }
      rows.l[r] = rows.l[r] * corr + sum;
      rows.m[r] = m_new;
    }
    float* value = sc.value.data();
    for (int j = 0; j < nk; ++j) {
      if (!used[j]) continue;
      decode_value<M>(fmt, src.view, th[j], value);
      for (int r = 0; r < rows.n; ++r) {
        if (!sc.seen[size_t(r) * kKeyTile + j]) continue;
        float* acc = main ? &rows.accm[size_t(r) * d] : &rows.acc[size_t(r) * d];
        axpy(acc, sc.scores[size_t(r) * kKeyTile + j], value, d);
      }
    }
  }
}

void segment(const AttentionStep& s, const Item& it, Kind kind, int64_t lo, int64_t hi,
             const int64_t* pos, Rows& rows, Scratch& sc) {
  const Format& fmt = *(kind == Kind::Main ? s.main : s.recent).format;
  switch (fmt.mode) {
#define TQX_MODE(m) \
  case Mode::m: return run_segment<Mode::m>(s, it, kind, lo, hi, pos, rows, sc);
    TQX_MODE(NONE)
    TQX_MODE(FP8_PER_TENSOR)
    TQX_MODE(INT8_PER_TOKEN_HEAD)
    TQX_MODE(FP8_PER_TOKEN_HEAD)
    TQX_MODE(INT4_PER_TOKEN_HEAD)
    TQX_MODE(NVFP4)
    TQX_MODE(TURBOQUANT)
#undef TQX_MODE
  }
}

}  // namespace

void run_item(const AttentionStep& s, const Item& it, float* partial) {
  const int d = s.head_size, groups = s.num_heads / s.kv_heads;
  const Format& f = *s.format;
  const int n = static_cast<int>((it.q1 - it.q0) * groups);
  Rows rows(n, d);
  std::vector<float> rotated(d);
  for (int r = 0; r < n; ++r) {
    const int64_t t = it.q0 + r / groups, head = it.head * groups + r % groups;
    float* q = &rows.q[size_t(r) * d];
    float* qm = &rows.qm[size_t(r) * d];
    std::copy_n(s.q + (t * s.num_heads + head) * d, d, q);
    std::copy_n(q, d, rotated.data());
    if (f.key_rotated()) hadamard(rotated.data(), d);
    if (f.key_parts())
      to_parts(rotated.data(), qm, d);
    else
      std::copy_n(rotated.data(), d, qm);
  }
  std::vector<int64_t> pos(s.positions + it.q0, s.positions + it.q1);
  const int64_t pmin = *std::min_element(pos.begin(), pos.end());
  const int64_t pmax = *std::max_element(pos.begin(), pos.end());
  // each segment's keys for these queries: [lo, hi], then cut to the item's split
  const int64_t last = std::min(s.seq_lens[it.seq] - 1, pmax);
  const int64_t wlo = s.window ? std::max<int64_t>(0, pmin - s.window + 1) : 0;
  const int64_t n_recent = s.recent_window, sinks = s.sink_tokens;
  const int64_t lo[3] = {std::max(wlo, n_recent ? sinks : int64_t(0)),
                         std::max({wlo, sinks, pmin - n_recent + 1}), wlo};
  const int64_t hi[3] = {n_recent ? std::min(last, pmax - n_recent) : last,
                         n_recent ? last : -1, sinks ? std::min(last, sinks - 1) : -1};
  const Kind kinds[3] = {Kind::Main, Kind::Recent, Kind::Sink};
  Scratch sc(n, d);
  for (int g = 0; g < 3; ++g) {
    const int64_t a = std::max(lo[g], it.k0), b = std::min(hi[g], it.k1 - 1);
    if (a <= b) segment(s, it, kinds[g], a, b, pos.data(), rows, sc);
  }
  if (!partial) {
    for (int r = 0; r < n; ++r)
      attn::finish_row(s, it.q0 + r / groups, it.head * groups + r % groups, rows.l[r],
                       &rows.acc[size_t(r) * d], &rows.accm[size_t(r) * d]);
    return;
  }
  const size_t row_floats = 2 + size_t(d) * 2;
  for (int r = 0; r < n; ++r, partial += row_floats) {
    partial[0] = rows.m[r];
    partial[1] = rows.l[r];
    std::copy_n(&rows.acc[size_t(r) * d], d, partial + 2);
    std::copy_n(&rows.accm[size_t(r) * d], d, partial + 2 + d);
  }
}

}  // namespace TQX_ISA
}  // namespace tqx
