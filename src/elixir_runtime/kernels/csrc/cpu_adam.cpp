// Fused CPU Adam/AdamW over a flat arena: one memory pass per element that reads the fp32
// master/m/v and the grad (fp32, bf16 or fp16), writes master/m/v back, and writes the new param
// in bf16/fp16 to an output buffer (e.g. pinned, for the copy to the GPU). A C ABI with raw
// pointers, loaded by ctypes: no dependence on the torch C++ ABI.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
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

// The update for one element, in the same order as torch.optim.AdamW's single-tensor path. Every
// operation (fma included) matches the vector code's exactly, so results are bitwise the same
// whatever the ISA, thread count, tiling or alignment.
template <int GT, int OT>
inline void scalar_range(float* p, float* m, float* v, const void* g, void* out, int64_t i, int64_t end,
                         const Consts& c) {
  for (; i < end; ++i) {
    float gi = Scalar<GT>::load(g, i) * c.grad_mul;
    float pi = p[i] * c.decay_mul;
    gi = std::fma(pi, c.l2, gi);
    float mi = std::fma(c.omb1, gi - m[i], m[i]);
    float vi = std::fma(c.omb2, gi * gi, v[i] * c.b2);
    float denom = std::fma(std::sqrt(vi), c.inv_bc2, c.eps);
    pi = std::fma(-c.step_size, mi / denom, pi);
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

// Two vectors per iteration give the out-of-order core independent work to overlap with the
// loads (a few % here). Advances `i` past the last whole vector; the caller finishes the tail.
template <int GT, int OT>
inline void vector_range(float* p, float* m, float* v, const void* g, void* out, int64_t& i, int64_t end,
                         const Consts& c) {
  const Vec step = Vec::set1(-c.step_size), inv_bc2 = Vec::set1(c.inv_bc2), omb1 = Vec::set1(c.omb1),
            b2 = Vec::set1(c.b2), omb2 = Vec::set1(c.omb2), eps = Vec::set1(c.eps),
            decay = Vec::set1(c.decay_mul), l2 = Vec::set1(c.l2), gmul = Vec::set1(c.grad_mul);
  auto one = [&](int64_t j) {
    prefetch_ahead(p, j, 4);
    prefetch_ahead(m, j, 4);
    prefetch_ahead(v, j, 4);
    prefetch_ahead(g, j, GT == kF32 ? 4 : 2);
    Vec gj = Simd<GT>::load(g, j) * gmul;
    Vec pj = Vec::load(p + j) * decay;
    gj = Vec::fma(pj, l2, gj);
    Vec mj = Vec::load(m + j);
    mj = Vec::fma(omb1, gj - mj, mj);
    Vec vj = Vec::fma(omb2, gj * gj, Vec::load(v + j) * b2);
    Vec denom = Vec::fma(Vec::sqrt(vj), inv_bc2, eps);
    pj = Vec::fma(step, mj / denom, pj);
    pj.store(p + j);
    mj.store(m + j);
    vj.store(v + j);
    if constexpr (OT != kNone) Simd<OT>::stream(out, j, pj);
  };
  if constexpr (OT != kNone) {  // scalar steps up to the alignment the streaming stores need
    constexpr uintptr_t kAlign = 2 * kWidth;
    uintptr_t addr = reinterpret_cast<uintptr_t>(static_cast<uint16_t*>(out) + i);
    int64_t peel = std::min<int64_t>(end - i, int64_t((kAlign - addr % kAlign) % kAlign / 2));
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

}  // extern "C"
