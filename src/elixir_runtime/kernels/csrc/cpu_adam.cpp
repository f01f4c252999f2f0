// Fused CPU Adam/AdamW over a flat arena: one memory pass per element that reads the fp32
// master/m/v and the grad (fp32, bf16 or fp16), writes master/m/v back, and writes the new param
// in bf16/fp16 to an output buffer (e.g. pinned, for the copy to the GPU). A C ABI with raw
// pointers, loaded by ctypes: no dependence on the torch C++ ABI.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_adam_simd.h"

namespace elixir {

// Mirrors `_Seg` in cpu_adam.py: an arena range and the index of its group's constants.
struct Seg {
  int64_t offset;
  int64_t length;
  int64_t group;
};

// Mirrors CONST_NAMES in adam_consts.py: one param group's constants for this step, in double.
struct Group {
  double step_size;     // lr / (1 - beta1^t)
  double inv_bc2_sqrt;  // 1 / sqrt(1 - beta2^t)
  double omb1, beta2, omb2, eps;
  double decay_mul;     // 1 - lr*wd for AdamW, else 1
  double l2;            // wd for Adam (L2 into the grad), else 0
  double grad_mul;      // 1 / div_scale
};

struct Consts {
  float step_size, inv_bc2, omb1, b2, omb2, eps, decay_mul, l2, grad_mul;
  explicit Consts(const Group& g)
      : step_size(float(g.step_size)), inv_bc2(float(g.inv_bc2_sqrt)), omb1(float(g.omb1)), b2(float(g.beta2)),
        omb2(float(g.omb2)), eps(float(g.eps)), decay_mul(float(g.decay_mul)), l2(float(g.l2)),
        grad_mul(float(g.grad_mul)) {}
};

// A group's constants as operands of the update: float for the scalar code, Vec broadcasts for the
// vector code.
template <class T>
struct K {
  T neg_step, inv_bc2, omb1, b2, omb2, eps, decay, l2, gmul;
  template <class Bcast>
  K(const Consts& c, Bcast b)
      : neg_step(b(-c.step_size)), inv_bc2(b(c.inv_bc2)), omb1(b(c.omb1)), b2(b(c.b2)), omb2(b(c.omb2)),
        eps(b(c.eps)), decay(b(c.decay_mul)), l2(b(c.l2)), gmul(b(c.grad_mul)) {}
};
inline float fma_(float a, float b, float c) { return std::fma(a, b, c); }
inline float sqrt_(float a) { return std::sqrt(a); }
inline K<float> scalar_consts(const Consts& c) {
  return K<float>(c, [](float x) { return x; });
}

// The update of one element (float) or kWidth of them (Vec), in the same order as
// torch.optim.AdamW's single-tensor path: the one definition both kernels (fp32 and 8-bit moments)
// and both code paths run. Every operation (fma included) is the same IEEE operation in either type,
// so results are bitwise the same whatever the ISA, thread count, tiling or alignment.
template <class T>
inline void adam_update(T& p, T& m, T& v, T g, const K<T>& k) {
  g = g * k.gmul;
  p = p * k.decay;
  g = fma_(p, k.l2, g);
  m = fma_(k.omb1, g - m, m);
  v = fma_(k.omb2, g * g, v * k.b2);
  T denom = fma_(sqrt_(v), k.inv_bc2, k.eps);
  p = fma_(k.neg_step, m / denom, p);
}

template <int GT, int OT>
inline void scalar_range(float* p, float* m, float* v, const void* g, void* out, int64_t i, int64_t end,
                         const Consts& c) {
  const K<float> k = scalar_consts(c);
  for (; i < end; ++i) {
    float pi = p[i], mi = m[i], vi = v[i];
    adam_update(pi, mi, vi, Scalar<GT>::load(g, i), k);
    p[i] = pi;
    m[i] = mi;
    v[i] = vi;
    if constexpr (OT != kNone) Scalar<OT>::store(out, i, pi);
  }
}

#ifdef ELIXIR_HAS_VEC
// [Note: prefetch] Each element is a few vector operations on five arrays (four read, three of
// them written back, one streamed out), so a core's share of the update is bound by how many cache
// misses it keeps in flight. The hardware prefetchers stop at every 4 KiB page and ramp up again
// per array; the loads ask for each array's line kPrefetch elements ahead of use instead (a page
// of fp32; a line asked for twice costs next to nothing). Prefetches change no result and never
// fault past the end of an arena.
constexpr int64_t kPrefetch = 1024;

// The line `kPrefetch` elements past element `j` of an array of `bytes`-sized elements (integer
// arithmetic: the address may lie past the array's end).
inline void prefetch_ahead(const void* base, int64_t j, int64_t bytes) {
  _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(base) + (j + kPrefetch) * bytes), _MM_HINT_T0);
}

inline Vec fma_(Vec a, Vec b, Vec c) { return Vec::fma(a, b, c); }
inline Vec sqrt_(Vec a) { return Vec::sqrt(a); }
inline K<Vec> vector_consts(const Consts& c) {
  return K<Vec>(c, [](float x) { return Vec::set1(x); });
}

// Scalar elements from `i` up to the alignment the streaming 16-bit stores need at `out + i`.
inline int64_t peel_to_stream(const void* out, int64_t i, int64_t end) {
  constexpr uintptr_t kAlign = 2 * kWidth;
  uintptr_t addr = reinterpret_cast<uintptr_t>(static_cast<const uint16_t*>(out) + i);
  return std::min<int64_t>(end - i, int64_t((kAlign - addr % kAlign) % kAlign / 2));
}

// Two vectors per iteration give the out-of-order core independent work to overlap with the
// loads (a few % here). Advances `i` past the last whole vector; the caller finishes the tail.
template <int GT, int OT>
inline void vector_range(float* p, float* m, float* v, const void* g, void* out, int64_t& i, int64_t end,
                         const Consts& c) {
  const K<Vec> k = vector_consts(c);
  auto one = [&](int64_t j) {
    prefetch_ahead(p, j, 4);
    prefetch_ahead(m, j, 4);
    prefetch_ahead(v, j, 4);
    prefetch_ahead(g, j, GT == kF32 ? 4 : 2);
    Vec pj = Vec::load(p + j), mj = Vec::load(m + j), vj = Vec::load(v + j);
    adam_update(pj, mj, vj, Simd<GT>::load(g, j), k);
    pj.store(p + j);
    mj.store(m + j);
    vj.store(v + j);
    if constexpr (OT != kNone) Simd<OT>::stream(out, j, pj);
  };
  if constexpr (OT != kNone) {  // scalar steps up to the alignment the streaming stores need
    int64_t peel = peel_to_stream(out, i, end);
    scalar_range<GT, OT>(p, m, v, g, out, i, i + peel, c);
    i += peel;
  }
  for (; i + 2 * kWidth <= end; i += 2 * kWidth) {
    one(i);
    one(i + kWidth);
  }
  for (; i + kWidth <= end; i += kWidth) one(i);
  if constexpr (OT != kNone) _mm_sfence();  // streamed stores land before the call returns
}
#endif

template <int GT, int OT>
void update_range(float* p, float* m, float* v, const void* g, void* out, int64_t i, int64_t end,
                  const Consts& c) {
#ifdef ELIXIR_HAS_VEC
  vector_range<GT, OT>(p, m, v, g, out, i, end, c);
#endif
  scalar_range<GT, OT>(p, m, v, g, out, i, end, c);
}

using RangeFn = void (*)(float*, float*, float*, const void*, void*, int64_t, int64_t, const Consts&);

template <int GT>
RangeFn pick_out(int out_dtype) {
  switch (out_dtype) {
    case kBF16: return update_range<GT, kBF16>;
    case kF16: return update_range<GT, kF16>;
    case kNone: return update_range<GT, kNone>;
    default: return nullptr;
  }
}

RangeFn pick(int grad_dtype, int out_dtype) {
  switch (grad_dtype) {
    case kF32: return pick_out<kF32>(out_dtype);
    case kBF16: return pick_out<kBF16>(out_dtype);
    case kF16: return pick_out<kF16>(out_dtype);
    default: return nullptr;
  }
}

// Below this many elements per thread, OpenMP's fork/join costs more than it saves.
constexpr int64_t kMinPerThread = 1 << 15;
// A block's fp32 arrays span 1 MiB each: long runs for the prefetchers, many blocks to balance.
constexpr int64_t kMaxBlock = 1 << 18;

// One segment clipped to the call's range, placed in the concatenated "work" index space.
struct Range {
  int64_t begin, end, work;
  Consts c;
};

// ----------------------------------------------------------------------------------- 8-bit moments
// [Note: 8-bit kernel]
// The moments are uint8 codes of quant8.py's maps with one fp32 scale per kQuantBlock elements
// (adam_state.py, [Note: 8-bit moments]); segments start at block boundaries, so a block belongs to
// one segment and one thread does it whole, in three passes over L1-resident data:
//  1. dequantize m and v (code[c] * scale), run adam_update (the fp32 kernel's math, so an element's
//     new p, m and v are bitwise what the fp32 kernel computes from the dequantized moments), write
//     p and out, keep the new m and v on the stack with their largest magnitudes: a max over bit
//     patterns (a float's magnitude orders as its bits, NaN above inf), exact in any order;
//  2. store the two new scales (NaN where a value is NaN, as torch's amax);
//  3. quantize: x = value / scale (IEEE division; x = 0 where the scale is not > 0), the code of x
//     as quant8's bucket and midpoint rule ([Note: nearest code by bucket] in quant8.py) in one
//     lookup ([Note: one lookup per code] in cpu_adam.py).
// Scalar and vector code do the same IEEE operations and exact integer lookups (permutes, gathers),
// so master, codes and scales are bitwise the same across ISAs and thread counts, and the codes and
// scales equal quant8.quantize of the same fp32 moments. Elements past a segment's end (the block's
// zero padding) are neither read nor written.
// Per element the update moves 16 bytes (p read and written, two codes read and written, a bf16
// grad and out) against the fp32 kernel's 28, but four table lookups make it compute bound
// ([Note: 8-bit rate] in cpu_adam.py).
constexpr int64_t kQuantBlock = 256;  // adam_state.QUANT_BLOCK

// Mirrors `_Map` in cpu_adam.py: one moment's map.
struct Map {
  const float* code;    // quant8: the 256 values a code stands for
  const uint32_t* key;  // per top-16-bit pattern of x: code << 16 | threshold ([Note: one lookup per code])
};

// The code of x (|x| <= 1 or NaN).
inline uint8_t encode(float x, const Map& t) {
  uint32_t b = f2u(x), e = t.key[b >> 16];
  return uint8_t((e >> 16) + (((b ^ uint32_t(int32_t(b) >> 31)) & 0xffffu) > (e & 0xffffu)));
}

// dst[k] = code[codes[k]] * scale for k < n.
inline void dequantize(float* dst, const uint8_t* codes, int64_t n, float scale, const float* code) {
  int64_t i = 0;
#ifdef ELIXIR_HAS_VEC
  const CodeTable table(code);
  const Vec s = Vec::set1(scale);
  for (; i + kWidth <= n; i += kWidth) (table.lookup(codes + i) * s).store(dst + i);
#endif
  for (; i < n; ++i) dst[i] = code[codes[i]] * scale;
}

// The codes of `n` values under `scale`.
inline void quantize(uint8_t* dst, const float* val, int64_t n, float scale, const Map& t) {
  if (!(scale > 0.0f)) {  // all zero (or NaN): x = 0, as quant8.quantize
    std::memset(dst, encode(0.0f, t), size_t(n));
    return;
  }
  int64_t i = 0;
#ifdef ELIXIR_HAS_VEC
  const Vec s = Vec::set1(scale);
  for (; i + kWidth <= n; i += kWidth) store_codes(dst + i, Vec::load(val + i) / s, t.key);
#endif
  for (; i < n; ++i) dst[i] = encode(val[i] / scale, t);
}

struct Arena8 {
  float* p;
  uint8_t* mc;
  uint8_t* vc;
  float* ms;
  float* vs;
  const void* g;
  void* out;
  const Map* maps;  // exp_avg's, exp_avg_sq's
};

// One block: elements [b0, b0 + n), b0 a multiple of kQuantBlock, 0 < n <= kQuantBlock.
template <int GT, int OT>
inline void update_block8(const Arena8& a, int64_t b0, int64_t n, const Consts& c) {
  const int64_t q = b0 / kQuantBlock;
  alignas(64) float nm[kQuantBlock], nv[kQuantBlock];
  dequantize(nm, a.mc + b0, n, a.ms[q], a.maps[0].code);
  dequantize(nv, a.vc + b0, n, a.vs[q], a.maps[1].code);
  uint32_t am = 0, av = 0;
  const K<float> k = scalar_consts(c);
  auto one = [&](int64_t i) {
    const int64_t j = b0 + i;
    float pj = a.p[j], mj = nm[i], vj = nv[i];
    adam_update(pj, mj, vj, Scalar<GT>::load(a.g, j), k);
    a.p[j] = pj;
    nm[i] = mj;
    nv[i] = vj;
    am = std::max(am, f2u(mj) & 0x7fffffffu);
    av = std::max(av, f2u(vj) & 0x7fffffffu);
    if constexpr (OT != kNone) Scalar<OT>::store(a.out, j, pj);
  };
  int64_t i = 0;
#ifdef ELIXIR_HAS_VEC
  if constexpr (OT != kNone)
    for (const int64_t peel = peel_to_stream(a.out, b0, b0 + n); i < peel; ++i) one(i);
  const K<Vec> kv = vector_consts(c);
  Vec amv = Vec::set1(0.0f), avv = Vec::set1(0.0f);
  for (; i + kWidth <= n; i += kWidth) {
    const int64_t j = b0 + i;
    Vec pj = Vec::load(a.p + j), mj = Vec::load(nm + i), vj = Vec::load(nv + i);
    adam_update(pj, mj, vj, Simd<GT>::load(a.g, j), kv);
    pj.store(a.p + j);
    mj.store(nm + i);
    vj.store(nv + i);
    amv = max_abs_bits(amv, mj);
    avv = max_abs_bits(avv, vj);
    if constexpr (OT != kNone) Simd<OT>::stream(a.out, j, pj);
  }
  am = std::max(am, hmax_bits(amv));
  av = std::max(av, hmax_bits(avv));
#endif
  for (; i < n; ++i) one(i);
  a.ms[q] = u2f(am);
  a.vs[q] = u2f(av);
  quantize(a.mc + b0, nm, n, u2f(am), a.maps[0]);
  quantize(a.vc + b0, nv, n, u2f(av), a.maps[1]);
}

// The blocks starting at elements [b0, b1) of a segment ending at element `end`.
template <int GT, int OT>
void update_blocks8(const Arena8& a, int64_t b0, int64_t b1, int64_t end, const Consts& c) {
  for (; b0 < b1; b0 += kQuantBlock) update_block8<GT, OT>(a, b0, std::min(kQuantBlock, end - b0), c);
#ifdef ELIXIR_HAS_VEC
  if constexpr (OT != kNone) _mm_sfence();
#endif
}

using BlocksFn = void (*)(const Arena8&, int64_t, int64_t, int64_t, const Consts&);

template <int GT>
BlocksFn pick8_out(int out_dtype) {
  switch (out_dtype) {
    case kBF16: return update_blocks8<GT, kBF16>;
    case kF16: return update_blocks8<GT, kF16>;
    case kNone: return update_blocks8<GT, kNone>;
    default: return nullptr;
  }
}

BlocksFn pick8(int grad_dtype, int out_dtype) {
  switch (grad_dtype) {
    case kF32: return pick8_out<kF32>(out_dtype);
    case kBF16: return pick8_out<kBF16>(out_dtype);
    case kF16: return pick8_out<kF16>(out_dtype);
    default: return nullptr;
  }
}

// One segment's blocks, placed in the concatenated "work" index space (counted in blocks).
struct Range8 {
  int64_t begin, end, work;  // elements [begin, end); begin is block-aligned
  Consts c;
};

}  // namespace elixir

extern "C" {

const char* elixir_adam_isa() { return elixir::kIsa; }

// Updates every segment's part of [lo, hi) in one parallel region. Returns 0, or -1 for an
// unsupported dtype code.
int elixir_adam_step(float* p, float* m, float* v, const void* g, int grad_dtype, void* out, int out_dtype,
                     const elixir::Seg* segs, int64_t nseg, const elixir::Group* groups, int64_t lo, int64_t hi,
                     int nthreads) {
  using namespace elixir;
  RangeFn fn = pick(grad_dtype, out_dtype);
  if (fn == nullptr) return -1;
  std::vector<Range> ranges;
  int64_t total = 0;
  for (int64_t s = 0; s < nseg; ++s) {
    int64_t a = std::max(lo, segs[s].offset), b = std::min(hi, segs[s].offset + segs[s].length);
    if (b <= a) continue;
    ranges.push_back({a, b, total, Consts(groups[segs[s].group])});
    total += b - a;
  }
  if (total == 0) return 0;
  int threads = int(std::clamp<int64_t>(total / kMinPerThread, 1, std::max(1, nthreads)));
  // Blocks of whole multiples of 64 elements, handed out dynamically: a thread slowed by other work
  // on its core (the training loop's own threads) doesn't hold the others up.
  int64_t block = std::min(kMaxBlock, ((total + threads - 1) / threads + 63) / 64 * 64);
  int64_t nblocks = (total + block - 1) / block;

#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (int64_t b = 0; b < nblocks; ++b) {
    int64_t wb = b * block, we = std::min(total, wb + block);
    auto x = std::upper_bound(ranges.begin(), ranges.end(), wb, [](int64_t w, const Range& r) { return w < r.work; });
    for (--x; x != ranges.end() && x->work < we; ++x) {  // the ranges overlapping [wb, we)
      int64_t from = std::max(wb, x->work), to = std::min(we, x->work + (x->end - x->begin));
      fn(p, m, v, g, out, x->begin + (from - x->work), x->begin + (to - x->work), x->c);
    }
  }
  return 0;
}

// The 8-bit moments' update ([Note: 8-bit kernel]) of every segment in one parallel region: p fp32;
// mc/vc uint8 codes and ms/vs fp32 scales (one per kQuantBlock elements) of exp_avg/exp_avg_sq;
// maps[0]/maps[1] their tables. Returns 0, -1 for an unsupported dtype code, -2 for a segment that
// does not start a block.
int elixir_adam8_step(float* p, uint8_t* mc, uint8_t* vc, float* ms, float* vs, const void* g, int grad_dtype,
                      void* out, int out_dtype, const elixir::Seg* segs, int64_t nseg, const elixir::Group* groups,
                      const elixir::Map* maps, int nthreads) {
  using namespace elixir;
  BlocksFn fn = pick8(grad_dtype, out_dtype);
  if (fn == nullptr) return -1;
  std::vector<Range8> ranges;
  int64_t total = 0, elements = 0;
  for (int64_t s = 0; s < nseg; ++s) {
    const Seg& x = segs[s];
    if (x.offset % kQuantBlock) return -2;
    if (x.length <= 0) continue;
    ranges.push_back({x.offset, x.offset + x.length, total, Consts(groups[x.group])});
    total += (x.length + kQuantBlock - 1) / kQuantBlock;
    elements += x.length;
  }
  if (total == 0) return 0;
  int threads = int(std::clamp<int64_t>(elements / kMinPerThread, 1, std::max(1, nthreads)));
  // Tasks of whole blocks, at most kMaxBlock elements, handed out dynamically (as above).
  int64_t task = std::min(kMaxBlock / kQuantBlock, (total + threads - 1) / threads);
  int64_t ntasks = (total + task - 1) / task;

  const Arena8 a{p, mc, vc, ms, vs, g, out, maps};
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (int64_t t = 0; t < ntasks; ++t) {
    int64_t wb = t * task, we = std::min(total, wb + task);
    auto x = std::upper_bound(ranges.begin(), ranges.end(), wb, [](int64_t w, const Range8& r) { return w < r.work; });
    for (--x; x != ranges.end() && x->work < we; ++x) {  // the ranges overlapping blocks [wb, we)
      int64_t blocks = (x->end - x->begin + kQuantBlock - 1) / kQuantBlock;
      int64_t from = std::max(wb, x->work) - x->work, to = std::min(we, x->work + blocks) - x->work;
      fn(a, x->begin + from * kQuantBlock, x->begin + to * kQuantBlock, x->end, x->c);
    }
  }
  return 0;
}

}  // extern "C"
