// The attention work item, compiled once per instruction set (TQX_ISA names the namespace:
// avx512, avx2 or base; the build passes the matching -march). Each item reads every slot it
// needs once, straight from the paged blocks, decodes it into a small tile, and keeps an
// online softmax per query row. Its vector code is written against simd.h's primitives.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#ifndef TQX_ISA
#define TQX_ISA base
#endif

#include "attention.h"
#include "decode.h"
#include "exp.h"
#include "simd.h"

namespace tqx {
namespace TQX_ISA {
namespace {

using attn::kNegInf;
constexpr int kKeyTile = 32;
constexpr int kQueryBlockRows = attn::kQueryBlock;  // queries of an item, at most
constexpr int kFusedRows = 4;  // query rows per pass of accumulate_codes4

enum class Kind { Main, Recent, Sink };

// lanes of x . y (their sum: the dot product), over d floats
inline simd::Floats dot_lanes(const float* x, const float* y, int d) {
  using namespace simd;
  Floats s = zero();
  int i = 0;
  for (; i + kLanes <= d; i += kLanes) s = fmadd(load(x + i), load(y + i), s);
  if (i < d) s = fmadd(load_first(x + i, d - i), load_first(y + i, d - i), s);
  return s;
}

// out[j] = a[j] . b for j < n (b null: a[j] . a[j]), kLanes keys per reduction
inline void dots(const float* const* a, const float* b, int n, int d, float* out) {
  using namespace simd;
  for (int j = 0; j < n; j += kLanes) {
    const int m = std::min(kLanes, n - j);
    Floats v[kLanes];
    for (int k = 0; k < kLanes; ++k) {
      const float* x = a[std::min(j + k, n - 1)];
      v[k] = k < m ? dot_lanes(x, b ? b : x, d) : zero();
    }
    store_first(out + j, sum_lanes(v), m);
  }
}

// The vector kernels (AVX-512, AVX2) score and weigh 4-bit TurboQuant codes in registers
// (score_codes4, accumulate_codes4); the baseline one decodes them into the tile first.
constexpr bool kFusedCodes4 = simd::kLanes >= 8;
// query rows per pass of score_codes4: AVX-512 holds 64-float queries in registers, AVX2 reads
// them from memory and has the registers for 8 rows' sums (a GQA group of Qwen's 7 in one)
constexpr int kScoreRows = simd::kLanes == 16 ? 4 : 8;

// Scores of a tile's keys stored as 4-bit codes in parts order (key[j]: key j's d / 2 bytes,
// d a multiple of 2 * kLanes) against R query rows in parts order, and each key's squared
// norm: the keys are decoded in registers, each read once for every row.
// out[r][j] = q[r] . key j.
// D: the head size when known at compile time (the rows' queries then stay in registers; only
// the 16-lane kernel has the registers for them), or 0
template <int R, int D>
void score_codes4(const uint8_t* const* key, int nk, int d, const float* table,
                  const float* const* q, float* const* out, float* sumsq) {
  using namespace simd;
  if (D) d = D;
  const int half = d / 2;
  const Table16 t = load_table16(table);
  constexpr int kHeld = D ? D / kLanes : 1;
  Floats qv[R][kHeld];
  for (int r = 0; D && r < R; ++r)
    for (int i = 0; i < kHeld; ++i) qv[r][i] = load(q[r] + kLanes * i);
  auto query = [&](int r, int i) {  // kLanes floats of row r from column i
    return D ? qv[r][i / kLanes] : load(q[r] + i);
  };
  for (int j0 = 0; j0 < nk; j0 += kLanes) {
    const int m = std::min(kLanes, nk - j0);
    Floats vs[R][kLanes], vn[kLanes];
    for (int k = 0; k < kLanes; ++k) {
      Floats a[R], n = zero();
      for (int r = 0; r < R; ++r) a[r] = zero();
      if (k < m) {
        const uint8_t* c = key[j0 + k];
        for (int i = 0; i < half; i += kLanes) {
          const Ints x = widen_bytes(c + i);
          const Floats lo = lookup(t, low_nibbles(x));
          const Floats hi = lookup(t, high_nibbles(x));
          n = fmadd(hi, hi, fmadd(lo, lo, n));
          for (int r = 0; r < R; ++r)
            a[r] = fmadd(hi, query(r, half + i), fmadd(lo, query(r, i), a[r]));
        }
      }
      vn[k] = n;
      for (int r = 0; r < R; ++r) vs[r][k] = a[r];
    }
    // out and sumsq hold whole tiles (kKeyTile floats): a full store forwards to the loads after
    store(sumsq + j0, sum_lanes(vn));
    for (int r = 0; r < R; ++r) store(out[r] + j0, sum_lanes(vs[r]));
  }
}

// acc[r] = acc[r] * corr[r] + sum_j w[r][j] * codes of value j (4-bit codes in parts order,
// code[j]: value j's d / 2 bytes, d a multiple of 2 * kLanes) for R rows. A pass holds in
// registers the columns of kChunks vectors of bytes (a byte's low nibble: a column of the first
// half, its high nibble: of the second) while the tile's codes stream past, so each byte is
// read once; R x 2 x kChunks sums fit the ISA's registers.
template <int R>
void accumulate_codes4(float* const* acc, const float* corr, const float* const* w,
                       const uint8_t* const* code, int nk, int d) {
  using namespace simd;
  constexpr int kChunks = kLanes == 16 ? 2 : 1;
  const int half = d / 2;
  for (int b0 = 0; b0 < half; b0 += kChunks * kLanes) {
    const int nc = std::min(kChunks, (half - b0) / kLanes);
    Floats a[R][2 * kChunks];
    for (int r = 0; r < R; ++r)
      for (int k = 0; k < nc; ++k) {
        a[r][2 * k] = mul(load(acc[r] + b0 + kLanes * k), broadcast(corr[r]));
        a[r][2 * k + 1] = mul(load(acc[r] + half + b0 + kLanes * k), broadcast(corr[r]));
      }
    for (int j = 0; j < nk; ++j)
      for (int k = 0; k < nc; ++k) {
        const Ints x = widen_bytes(code[j] + b0 + kLanes * k);
        const Floats lo = to_floats(low_nibbles(x)), hi = to_floats(high_nibbles(x));
        for (int r = 0; r < R; ++r) {
          const Floats wr = broadcast(w[r][j]);
          a[r][2 * k] = fmadd(wr, lo, a[r][2 * k]);
          a[r][2 * k + 1] = fmadd(wr, hi, a[r][2 * k + 1]);
        }
      }
    for (int r = 0; r < R; ++r)
      for (int k = 0; k < nc; ++k) {
        store(acc[r] + b0 + kLanes * k, a[r][2 * k]);
        store(acc[r] + half + b0 + kLanes * k, a[r][2 * k + 1]);
      }
  }
}

inline void accumulate_codes4_rows(float* const* acc, const float* corr, const float* const* w,
                                   int rows, const uint8_t* const* code, int nk, int d) {
  for (int r = 0; r < rows; r += kFusedRows) {
    switch (std::min(kFusedRows, rows - r)) {
      case 1: accumulate_codes4<1>(acc + r, corr + r, w + r, code, nk, d); break;
      case 2: accumulate_codes4<2>(acc + r, corr + r, w + r, code, nk, d); break;
      case 3: accumulate_codes4<3>(acc + r, corr + r, w + r, code, nk, d); break;
      default: accumulate_codes4<4>(acc + r, corr + r, w + r, code, nk, d); break;
    }
  }
}

template <int R>
inline void score_codes4_d(const uint8_t* const* key, int nk, int d, const float* table,
                           const float* const* q, float* const* out, float* sumsq) {
  if (simd::kLanes == 16 && d == 64)
    score_codes4<R, 64>(key, nk, d, table, q, out, sumsq);
  else
    score_codes4<R, 0>(key, nk, d, table, q, out, sumsq);
}

inline void score_codes4_rows(const uint8_t* const* key, int nk, int d, const float* table,
                              const float* const* q, int rows, float* const* out, float* sumsq) {
  for (int r = 0; r < rows; r += kScoreRows) {
    switch (std::min(kScoreRows, rows - r)) {
      case 1: score_codes4_d<1>(key, nk, d, table, q + r, out + r, sumsq); break;
      case 2: score_codes4_d<2>(key, nk, d, table, q + r, out + r, sumsq); break;
      case 3: score_codes4_d<3>(key, nk, d, table, q + r, out + r, sumsq); break;
      case 4: score_codes4_d<4>(key, nk, d, table, q + r, out + r, sumsq); break;
      case 5: score_codes4_d<5>(key, nk, d, table, q + r, out + r, sumsq); break;
      case 6: score_codes4_d<6>(key, nk, d, table, q + r, out + r, sumsq); break;
      case 7: score_codes4_d<7>(key, nk, d, table, q + r, out + r, sumsq); break;
      default: score_codes4_d<8>(key, nk, d, table, q + r, out + r, sumsq); break;
    }
  }
}

// acc[0, W) = acc * corr + sum_j p[j] * v_j (v_j = v + j * stride): the sums stay in registers
template <int W>
inline void accumulate(float* __restrict acc, float corr, const float* __restrict p,
                       const float* __restrict v, int n, int64_t stride) {
  float a[W];
  for (int l = 0; l < W; ++l) a[l] = acc[l] * corr;
  for (int j = 0; j < n; ++j) {
    const float pj = p[j];
    const float* x = v + size_t(j) * stride;
    for (int l = 0; l < W; ++l) a[l] += pj * x[l];
  }
  for (int l = 0; l < W; ++l) acc[l] = a[l];
}

// the same over a row of d: values v_j = v + j * stride (the tile: stride d)
// (out of line: inlined into the tile loop, its sums were spilled to the stack)
__attribute__((noinline)) void accumulate_row(float* acc, float corr, const float* p,
                                              const float* v, int n, int d, int64_t stride) {
  int c = 0;
  for (; c + 64 <= d; c += 64) accumulate<64>(acc + c, corr, p, v + c, n, stride);
  for (; c + 16 <= d; c += 16) accumulate<16>(acc + c, corr, p, v + c, n, stride);
  for (; c < d; c += 8) accumulate<8>(acc + c, corr, p, v + c, n, stride);  // d: a multiple of 8
}

// Runs of a tile's keys whose fp32 values lie at one stride in the cache (consecutive slots of
// a block, every one used): accumulated from the cache in place; other keys from the tile.
struct ValueRuns {
  int n = 0;
  int start[kKeyTile + 1];
  const float* base[kKeyTile];  // null: the tile's rows
};

// fp32 caches are read in place (a row per key, no copy into the tile)
template <Mode M>
inline const float* cache_row(const Format& f, const CacheView& c, int i, int64_t th) {
  return M == Mode::NONE && f.storage == Elem::float32
             ? reinterpret_cast<const float*>(c.data[i]) + th * f.head_size
             : nullptr;
}

alignas(64) constexpr float kZeroRow[gen::kMaxHeadSize] = {};
alignas(64) constexpr uint8_t kZeroCodes[gen::kMaxHeadSize / 2] = {};

// Per-row softmax state of one item: running max, sum, and the weighted value sums: of the
// recent cache (natural order) and of the layer's cache (in its basis and order, see
// attn::finish_row); queries as the recent cache and the layer's cache read them.
struct Rows {
  int n, d;
  std::vector<float> q, qm, m, l, acc, accm;
  Rows(int n_, int d_)
      : n(n_), d(d_), q(size_t(n_) * d_), qm(size_t(n_) * d_), m(n_, kNegInf), l(n_, 0.0f),
        acc(size_t(n_) * d_, 0.0f), accm(size_t(n_) * d_, 0.0f) {}
  // the rows' queries and row r's value sums as a segment of the layer's cache (main) or of
  // the recent cache reads them
  const float* queries(bool main) const { return main ? qm.data() : q.data(); }
  const float* query(bool main, int r) const { return queries(main) + size_t(r) * d; }
  float* sums(bool main, int r) { return (main ? accm : acc).data() + size_t(r) * d; }
};

struct Scratch {
  std::vector<float> keys, values, scores, corr;
  std::vector<uint8_t> live;
  Scratch(int rows, int d)
      : keys(size_t(kKeyTile) * d), values(size_t(kKeyTile) * d),
        scores(size_t(rows) * kKeyTile), corr(rows), live(rows) {}
};

// Asks for the cache lines of `heads` adjacent (token, head)s from `th` ahead of their use
// (blocks lie anywhere in memory: the hardware prefetcher stops at each block's end).
inline void prefetch_slots(const CacheView& c, int64_t th, int64_t heads) {
  for (int i = 0; i < gen::kMaxCacheTensors && c.data[i]; ++i) {
    const int64_t slot = int64_t(c.width[i]) * c.elem[i], bytes = slot * heads;
    const uint8_t* a = c.data[i] + th * slot;
    for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(a + o);
    __builtin_prefetch(a + bytes - 1);
  }
}

// The keys of a tile each query of an item sees (per query: kKeyTile flags, 0 past the tile's
// keys, and whether any), and those any query sees.
struct Visible {
  uint8_t seen[kQueryBlockRows][kKeyTile];
  bool any[kQueryBlockRows];
  uint8_t used[kKeyTile];
};

// the lane-wise maximum of N vectors from x, as a balanced tree
template <int N>
inline simd::Floats max_of_vectors(const float* x) {
  if constexpr (N == 1)
    return simd::load(x);
  else
    return simd::max(max_of_vectors<N / 2>(x), max_of_vectors<N - N / 2>(x + N / 2 * simd::kLanes));
}

// the largest of a tile's kKeyTile floats
inline float tile_max(const float* x) {
  static_assert(kKeyTile % simd::kLanes == 0, "whole vectors per tile");
  return simd::max_lane(max_of_vectors<kKeyTile / simd::kLanes>(x));
}

// A row's logits over a whole tile (kKeyTile lanes, so the loops vectorize): pr = score x kmul,
// softcapped, -inf where the row does not see the key; returns their maximum.
inline float tile_logits(float* __restrict pr, const float* __restrict kmul,
                         const uint8_t* __restrict seen, float softcap) {
  for (int j = 0; j < kKeyTile; ++j) pr[j] *= kmul[j];
  if (softcap != 0.0f)
    for (int j = 0; j < kKeyTile; ++j) pr[j] = std::tanh(pr[j] / softcap) * softcap;
  for (int j = 0; j < kKeyTile; ++j) pr[j] = seen[j] ? pr[j] : kNegInf;
  return tile_max(pr);
}

// pr = e^(pr - m) where the row sees the key, else 0; returns their sum.
inline float tile_exp(float* __restrict pr, const uint8_t* __restrict seen, float m) {
  float sum = 0.0f;
  for (int j = 0; j < kKeyTile; ++j) {
    const float e = exp_neg(pr[j] - m);
    pr[j] = seen[j] ? e : 0.0f;
    sum += pr[j];
  }
  return sum;
}

// A tile's keys for one kv head as the rows score them: key j's slot, its floats (decoded
// into the tile or read in place) or its 4-bit codes, and what its scores are multiplied by.
// Past the tile's keys, and where the sequence holds no key j: multiplier 0 and a finite row
// (those scores are dropped).
struct TileKeys {
  int64_t th[kKeyTile];
  const float* row[kKeyTile];
  const uint8_t* codes[kKeyTile];
  float mul[kKeyTile] = {};
};

// The tile's keys for kv head hh of the item (token[j]: key j's slot at the item's first kv
// head, -1 where the sequence holds none); those neither read in place nor scored from their
// codes are decoded into `tile`. False when the sequence holds none of them.
template <Mode M>
bool gather_keys(const AttentionStep& s, const PagedSource& src, int nk, const int64_t* token,
                 int64_t hh, bool from_codes, float* tile, TileKeys& keys) {
  const Format& fmt = *src.format;
  const int d = s.head_size;
  bool any = false;
  for (int j = 0; j < nk; ++j) {
    const int64_t th = keys.th[j] = token[j] + hh;
    keys.row[j] = kZeroRow;
    keys.codes[j] = kZeroCodes;
    if (token[j] < 0) continue;
    any = true;
    if (from_codes) {
      const uint8_t* slot = src.view.data[0] + th * fmt.layout->slot_size_aligned;
      keys.codes[j] = slot;
      keys.mul[j] = get_half(slot + fmt.layout->key_norm_offset) * s.scale;
      continue;
    }
    if (const float* row = cache_row<M>(fmt, src.view, 0, th)) {
      keys.row[j] = row;
      keys.mul[j] = s.scale;
      continue;
    }
    keys.row[j] = tile + size_t(j) * d;
    keys.mul[j] = decode_key<M>(fmt, src.view, th, tile + size_t(j) * d) * s.scale;
  }
  return any;
}

// Scores of rows r0 .. r0 + nr - 1 against the tile's 4-bit key codes, and each key's squared
// norm (sumsq)
void score_key_codes(const Format& fmt, const TileKeys& keys, int nk, int d,
                     const float* queries, int r0, int nr, Scratch& sc, float* sumsq) {
  for (int r = r0; r < r0 + nr; r += kScoreRows) {
    const int n = std::min(kScoreRows, r0 + nr - r);
    const float* qs[kScoreRows];
    float* out[kScoreRows];
    for (int i = 0; i < n; ++i) {
      qs[i] = queries + size_t(r + i) * d;
      out[i] = &sc.scores[size_t(r + i) * kKeyTile];
    }
    score_codes4_rows(keys.codes, nk, d, fmt.key_book->centroids, qs, n, out, sumsq);
  }
}

// TurboQuant norm correction of the tile's keys at once: each multiplier divided by its decoded
// key's norm (sumsq: the squared norms, computed here unless scoring from codes gave them)
void correct_norms(TileKeys& keys, int nk, int d, bool have_sumsq, float* sumsq) {
  if (!have_sumsq) dots(keys.row, nullptr, nk, d, sumsq);
  for (int j = nk; j < kKeyTile; ++j) sumsq[j] = 1.0f;
  for (int j = 0; j < kKeyTile; ++j) keys.mul[j] = keys.mul[j] / std::sqrt(sumsq[j] + gen::kNcEps);
}

// Folds a row's scores of one tile (pr) into its running max m and sum l; pr becomes the keys'
// weights. Returns the factor the row's earlier sums are to be scaled by.
inline float fold_tile(float& m, float& l, float* pr, const float* kmul, const uint8_t* seen,
                       float softcap) {
  const float m_new = std::max(m, tile_logits(pr, kmul, seen, softcap));
  // the running max rarely moves after the first tiles: no exponential then
  const float corr = m == m_new ? 1.0f : m == kNegInf ? 0.0f : exp_neg(m - m_new);
  const float sum = tile_exp(pr, seen, m_new);
  l = l * corr + sum;
  m = m_new;
  return corr;
}

// Scores rows r0 .. r0 + nr - 1 against the tile's keys (unless scored from their codes) and
// folds them into each row's softmax; rows that see none of the keys are not live.
void softmax_rows(const AttentionStep& s, const TileKeys& keys, int nk, bool scored, bool main,
                  const Visible& vis, Rows& rows, int r0, int nr, Scratch& sc) {
  const int d = s.head_size, groups = s.num_heads / s.kv_heads;
  for (int r = r0; r < r0 + nr; ++r) {
    const int tq = (r - r0) / groups;
    float* pr = &sc.scores[size_t(r) * kKeyTile];
    sc.live[r] = vis.any[tq];
    if (!vis.any[tq]) continue;
    if (!scored) dots(keys.row, rows.query(main, r), nk, d, pr);  // unseen keys: dropped below
    const float corr = fold_tile(rows.m[r], rows.l[r], pr, keys.mul, vis.seen[tq], s.softcap);
    sc.corr[r] = corr;  // applied to this segment's sums as they accumulate; the other's now:
    if (corr != 1.0f && s.recent.table) {
      float* other = rows.sums(!main, r);
      for (int i = 0; i < d; ++i) other[i] *= corr;
    }
  }
}

// Weighs the tile's 4-bit affine value codes (TurboQuant, one group) into the live rows' sums
// straight from the codes, never decoded to the tile (th: the keys' slots)
void weigh_value_codes(const AttentionStep& s, const PagedSource& src, int nk,
                       const int64_t* th, const uint8_t* used, bool main, Rows& rows, int r0,
                       int nr, const Scratch& sc) {
  const auto& lay = *src.format->layout;
  const int d = s.head_size;
  const uint8_t* vcodes[kKeyTile];
  float vscale[kKeyTile], voffset[kKeyTile];
  for (int j = 0; j < nk; ++j) {  // keys no row sees weigh 0 (their codes: any finite ones)
    const uint8_t* slot = used[j] ? src.view.data[0] + th[j] * lay.slot_size_aligned : nullptr;
    vcodes[j] = slot ? slot + lay.value_offset : kZeroCodes;
    vscale[j] = slot ? get_half(slot + lay.value_params_offset) : 0.0f;
    voffset[j] = slot ? get_half(slot + lay.value_params_offset + 2) : 0.0f;
  }
  for (int r = r0; r < r0 + nr;) {
    float* acc[kFusedRows];
    float corr[kFusedRows], offset[kFusedRows] = {}, w[kFusedRows][kKeyTile];
    const float* wr[kFusedRows];
    int n = 0;
    for (; r < r0 + nr && n < kFusedRows; ++r) {
      if (!sc.live[r]) continue;
      const float* p = &sc.scores[size_t(r) * kKeyTile];
      for (int j = 0; j < nk; ++j) {  // sum_j p_j (c_j s_j + o_j) = sum_j (p_j s_j) c_j + ...
        w[n][j] = p[j] * vscale[j];
        offset[n] += p[j] * voffset[j];
      }
      acc[n] = rows.sums(main, r);
      corr[n] = sc.corr[r];
      wr[n] = w[n];
      ++n;
    }
    if (n == 0) continue;
    accumulate_codes4_rows(acc, corr, wr, n, vcodes, nk, d);
    for (int i = 0; i < n; ++i)
      for (int c = 0; c < d; ++c) acc[i][c] += offset[i];
  }
}

// The tile's values as the rows weigh them: runs read in place, the others in the tile (affine
// formats: their codes, with a scale and offset per key)
struct TileValues {
  ValueRuns runs;
  float scale[kKeyTile], offset[kKeyTile];
};

// Finds the values of the keys the rows use (th: their slots), decoding those not read in place
// into `tile`; keys no row uses weigh 0, so their rows in the tile are zeros (finite).
template <Mode M>
void gather_values(const AttentionStep& s, const PagedSource& src, int nk, const int64_t* th,
                   const uint8_t* used, bool affine, float* tile, TileValues& values) {
  const Format& fmt = *src.format;
  const int d = s.head_size;
  ValueRuns& runs = values.runs;
  for (int j = 0; j < nk; ++j) {
    const float* row = used[j] ? cache_row<M>(fmt, src.view, 1, th[j]) : nullptr;
    const float* last = runs.n ? runs.base[runs.n - 1] : nullptr;
    const bool joins = runs.n && (row ? last && th[j] == th[j - 1] + s.kv_heads : !last);
    if (!joins) {
      runs.start[runs.n] = j;
      runs.base[runs.n++] = row;
    }
    if (row) continue;
    values.scale[j] = 1.0f;
    values.offset[j] = 0.0f;
    float* out = tile + size_t(j) * d;
    if (!used[j])
      std::fill_n(out, d, 0.0f);
    else if (affine)
      decode_value_codes<M>(fmt, src.view, th[j], out, values.scale[j], values.offset[j]);
    else
      decode_value<M>(fmt, src.view, th[j], out);
  }
  runs.start[runs.n] = nk;
}

// Adds the weighted values to the live rows' sums (scaled first by the row's correction)
void accumulate_values(const AttentionStep& s, const TileValues& values, int nk, bool affine,
                       const float* tile, bool main, Rows& rows, int r0, int nr,
                       const Scratch& sc) {
  const int d = s.head_size;
  const int64_t stride = int64_t(s.kv_heads) * d;
  const ValueRuns& runs = values.runs;
  for (int r = r0; r < r0 + nr; ++r) {
    if (!sc.live[r]) continue;
    float* acc = rows.sums(main, r);
    const float* p = &sc.scores[size_t(r) * kKeyTile];
    float corr = sc.corr[r];
    if (affine) {  // sum_j p_j (c_j s_j + o_j) = sum_j (p_j s_j) c_j + sum_j p_j o_j
      float w[kKeyTile], offset = 0.0f;
      for (int j = 0; j < nk; ++j) {
        w[j] = p[j] * values.scale[j];
        offset += p[j] * values.offset[j];
      }
      accumulate_row(acc, corr, w, tile, nk, d, d);
      for (int i = 0; i < d; ++i) acc[i] += offset;
      continue;
    }
    for (int k = 0; k < runs.n; ++k, corr = 1.0f) {
      const int a = runs.start[k], n = runs.start[k + 1] - a;
      if (runs.base[k])
        accumulate_row(acc, corr, p + a, runs.base[k], n, d, stride);
      else
        accumulate_row(acc, corr, p + a, tile + size_t(a) * d, n, d, d);
    }
  }
}

// One tile of keys p0 .. p0 + nk - 1 (token[j]: key j's slot for the item's first kv head, -1
// where the sequence holds no such key; vis: which keys each query sees) for kv head hh of the
// item, whose rows are r0 .. r0 + nr - 1: find and decode the keys, score the rows against them
// and fold the scores into each row's softmax, then weigh the values the rows use into their
// sums. 4-bit TurboQuant keys and values are read from their codes where kFusedCodes4.
template <Mode M>
void head_tile(const AttentionStep& s, Kind kind, const PagedSource& src, int nk,
               const int64_t* token, int64_t hh, const Visible& vis, Rows& rows, int r0, int nr,
               Scratch& sc) {
  const Format& fmt = *src.format;
  const int d = s.head_size;
  const bool main = kind == Kind::Main;
  const bool codes4 = M == Mode::TURBOQUANT && kFusedCodes4 && d % (2 * simd::kLanes) == 0;
  const bool key_codes = codes4 && fmt.key_parts();
  TileKeys keys;
  if (!gather_keys<M>(s, src, nk, token, hh, key_codes, sc.keys.data(), keys)) return;
  float sumsq[kKeyTile];
  if (key_codes) score_key_codes(fmt, keys, nk, d, rows.queries(main), r0, nr, sc, sumsq);
  if (tile_norm_correction(fmt)) correct_norms(keys, nk, d, key_codes, sumsq);
  softmax_rows(s, keys, nk, key_codes, main, vis, rows, r0, nr, sc);
  if (codes4 && fmt.value_parts()) {
    weigh_value_codes(s, src, nk, keys.th, vis.used, main, rows, r0, nr, sc);
    return;
  }
  const bool affine = value_codes_affine<M>(fmt);
  TileValues values;
  gather_values<M>(s, src, nk, keys.th, vis.used, affine, sc.values.data(), values);
  accumulate_values(s, values, nk, affine, sc.values.data(), main, rows, r0, nr, sc);
}

// Keys [first, last] of a sequence (none where first > last)
struct KeySpan {
  int64_t first, last;
};

// The keys a query at `position` sees in a segment: those up to its own and within the sliding
// window; of them the recent cache holds the sink tokens and the last recent_window positions,
// the layer's cache the others (ops.cc takes sink tokens only with a recent window).
inline KeySpan visible_keys(const AttentionStep& s, Kind kind, int64_t position) {
  const int64_t in_window =
      s.window ? position - s.window + 1 : std::numeric_limits<int64_t>::min();
  switch (kind) {
    case Kind::Main:
      return {std::max(in_window, s.sink_tokens),
              s.recent_window ? position - s.recent_window : position};
    case Kind::Recent:
      if (!s.recent_window) return {0, -1};
      return {std::max({in_window, s.sink_tokens, position - s.recent_window + 1}), position};
    case Kind::Sink:
      return {in_window, std::min(position, s.sink_tokens - 1)};
  }
  return {0, -1};
}

// The keys any query of an item sees in a segment, positions pmin .. pmax (both bounds of the
// rule grow with the position), cut to the sequence's seq_len keys
inline KeySpan item_keys(const AttentionStep& s, Kind kind, int64_t pmin, int64_t pmax,
                         int64_t seq_len) {
  return {std::max<int64_t>(0, visible_keys(s, kind, pmin).first),
          std::min(seq_len - 1, visible_keys(s, kind, pmax).last)};
}

// One segment's keys [lo, hi] for the rows of an item, format M: per tile of keys, each kv head
// of the item in turn (a token's heads are adjacent in the cache: the tile's slots are read
// front to back).
template <Mode M>
void run_segment(const AttentionStep& s, const Item& it, Kind kind, int64_t lo, int64_t hi,
                 const int64_t* pos, Rows& rows, Scratch& sc) {
  const PagedSource& src = kind == Kind::Main ? s.main : s.recent;
  const int32_t* table = src.table + it.seq * src.width;
  const int64_t seq_len = s.seq_lens[it.seq];
  const int64_t heads = it.h1 - it.h0;
  const int head_rows = static_cast<int>(rows.n / heads);
  // flat (token, head) index of keys p .. p + n - 1 at the item's first kv head, or -1 where
  // the sequence holds no such key (one division per call)
  auto slots = [&](int64_t p, int n, int64_t* out) {
    int64_t col = p / s.block_size, off = p % s.block_size;
    for (int j = 0; j < n; ++j, ++p) {
      const int32_t block = col < src.width ? table[col] : 0;
      out[j] = block == 0 || p >= seq_len
                   ? -1
                   : (int64_t(block) * s.block_size + off) * s.kv_heads + it.h0;
      if (++off == s.block_size) off = 0, ++col;
    }
  };
  const int queries = static_cast<int>(it.q1 - it.q0);
  KeySpan seen_by[kQueryBlockRows];
  for (int tq = 0; tq < queries; ++tq) seen_by[tq] = visible_keys(s, kind, pos[tq]);
  int64_t token[kKeyTile], next[kKeyTile];
  Visible vis;
  for (int64_t p0 = lo; p0 <= hi; p0 += kKeyTile) {
    const int nk = static_cast<int>(std::min<int64_t>(kKeyTile, hi - p0 + 1));
    std::fill(token + nk, token + kKeyTile, int64_t(-1));
    if (p0 == lo)
      slots(p0, nk, token);
    else
      std::copy_n(next, nk, token);
    const int nn = static_cast<int>(std::min<int64_t>(kKeyTile, hi - p0 - kKeyTile + 1));
    if (nn > 0) {
      slots(p0 + kKeyTile, nn, next);
      for (int j = 0; j < nn; ++j)
        if (next[j] >= 0) prefetch_slots(src.view, next[j], heads);
    }
    std::fill_n(vis.used, kKeyTile, uint8_t(0));
    for (int tq = 0; tq < queries; ++tq) {  // shared by the query's heads
      const int64_t a = seen_by[tq].first, b = seen_by[tq].last;
      uint8_t* seen = vis.seen[tq];
      int any = 0;
      for (int j = 0; j < kKeyTile; ++j) {
        seen[j] = (token[j] >= 0) & (p0 + j >= a) & (p0 + j <= b);
        any |= seen[j];
        vis.used[j] |= seen[j];
      }
      vis.any[tq] = any != 0;
    }
    for (int64_t hh = 0; hh < heads; ++hh)
      head_tile<M>(s, kind, src, nk, token, hh, vis, rows, static_cast<int>(hh) * head_rows,
                   head_rows, sc);
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
  const int n = static_cast<int>(it.rows(groups));
  Rows rows(n, d);
  std::vector<float> rotated(d);
  for (int r = 0; r < n; ++r) {
    const int64_t t = it.token(r, groups), head = it.head(r, groups);
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
  Scratch sc(n, d);
  for (const Kind kind : {Kind::Main, Kind::Recent, Kind::Sink}) {
    const KeySpan keys = item_keys(s, kind, pmin, pmax, s.seq_lens[it.seq]);
    const int64_t a = std::max(keys.first, it.k0), b = std::min(keys.last, it.k1 - 1);
    if (a <= b) segment(s, it, kind, a, b, pos.data(), rows, sc);
  }
  if (!partial) {
    for (int r = 0; r < n; ++r)
      attn::finish_row(s, it.token(r, groups), it.head(r, groups), rows.l[r],
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
