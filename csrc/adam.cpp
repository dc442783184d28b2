// Fused CPU Adam/AdamW step that also writes the fp16/bf16 copy of the parameters.
//
// One pass over fp32 param, grad, exp_avg and exp_avg_sq updates all three in place and,
// when `param16` is given, writes `param.to(param16.dtype)` in the same pass: a mixed-
// precision optimizer saves the separate cast's re-read of the fp32 params.
//
// The arithmetic is torch.optim.Adam/AdamW(foreach=False)'s single-tensor step, op for op,
// in the same order and with the same roundings as the ATen CPU kernels it calls (f32(x):
// the double x rounded to float, as ATen does with a Python scalar):
//   p = p * f32(1 - lr*wd)                    AdamW: param.mul_(1 - lr*wd)
//   g = fma(p, f32(wd), g)                    Adam:  grad.add(param, alpha=wd)
//   m = fma(w, g - m, m)   (|w| < 0.5)        exp_avg.lerp_(grad, w = 1 - beta1)
//       fma(w - 1, g - m, g)  (otherwise)
//   v = fma(f32(1-beta2) * g, g, v * beta2)   exp_avg_sq.mul_(beta2).addcmul_(grad, grad, 1 - beta2)
//   d = sqrt(v) / f32(bc2 ** 0.5) + eps       (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
//   p = (f32(-lr / bc1) * m) / d + p          param.addcdiv_(exp_avg, denom, value=-step_size)
// with bc1 = 1 - beta1**step, bc2 = 1 - beta2**step in double, as Python computes them.
// The result is bit-identical to torch's (tests/test_adam.py) provided that
//  * the file is compiled with -ffp-contract=off: GCC's vector intrinsics are plain vector
//    arithmetic that it would otherwise contract across what are separate ATen kernels
//    (p * s followed by + p, for one); the FMAs ATen does use are written out as fmadd;
//  * sqrt is the one Tensor.sqrt uses in this build (match_torch_sqrt=true): MKL's vmsSqrt
//    (VML_HA) when ATen has MKL, whose result is not always the correctly rounded square root
//    (1 ulp off for ~16% of inputs on AMD EPYC), else the vector sqrt. match_torch_sqrt=false
//    takes the vector sqrt always (correctly rounded, as torch's fused Adam kernel does).
//
// Work is split over ATen's intra-op threads (at::parallel_for). With the vector sqrt each
// thread makes one pass over its range; with vmsSqrt it walks the range in L1-resident
// blocks (moments, then vmsSqrt of the block, then params + downcast), so DRAM still sees
// each array once.
//
// Ops (library `tensorstow`, loaded with torch.ops.load_library; executor/adam.py registers
// the fake implementation):
//   adam_step_(param, grad, exp_avg, exp_avg_sq, param16, step, lr, beta1, beta2, eps,
//              weight_decay, decoupled_weight_decay, match_torch_sqrt, grad_scale=1.0) -> ()
//     param/exp_avg/exp_avg_sq: contiguous fp32 CPU tensors with the same numel; grad: contiguous,
//     that numel, fp32 or the 16-bit gradient of a mixed-precision step (read in its own width
//     and widened exactly, so the step equals one on `grad.float()`), times grad_scale in fp32
//     (clip_grad_norm_'s coefficient; 1: none);
//     param16: None or a contiguous bf16/fp16 CPU tensor with that numel; step: the step
//     number after this update (>= 1); decoupled_weight_decay: AdamW (true) or Adam (false).
//   adam_kernel_info() -> str

#include <ATen/ATen.h>
#include <ATen/Config.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <iterator>
#include <utility>

#if AT_MKL_ENABLED()
// Exported by libtorch_cpu (static MKL, LP64); ATen's vml.h calls it for Tensor.sqrt.
extern "C" void vmsSqrt(int n, const float* a, float* r, long long mode);
#endif

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t W = Vec::size();
constexpr int64_t kBlock = 1024;     // elements per L1-resident block of the VML path
constexpr int64_t kGrain = 1 << 15;  // below this many elements, one thread

#if AT_MKL_ENABLED()
constexpr long long kVmlMode = 0x2 | 0x100 | 0x140000;  // VML_HA | VML_ERRMODE_IGNORE | VML_FTZDAZ_OFF
constexpr bool kHaveVml = true;
#else
constexpr bool kHaveVml = false;
#endif

// Broadcast coefficients (see the table at the top of the file).
struct Coeffs {
  bool decay_param;  // AdamW with wd != 0: p *= 1 - lr*wd
  bool decay_grad;   // Adam with wd != 0:  g += wd * p
  bool w1_small;     // |1 - beta1| < 0.5: which lerp branch
  Vec wd_scale, wd, w1, w1m1, beta2, c2, bc2_sqrt, eps, neg_step;
};

struct Moments {
  Vec m, v;
};

template <bool kPartial>
inline Vec load(const float* ptr, int64_t k) {
  return kPartial ? Vec::loadu(ptr, k) : Vec::loadu(ptr);
}

template <bool kPartial>
inline void store(const Vec& x, float* ptr, int64_t k) {
  if (kPartial) {
    x.store(ptr, k);
  } else {
    x.store(ptr);
  }
}

template <typename out_t>
inline out_t* offset(out_t* out, int64_t i) {
  return out == nullptr ? nullptr : out + i;
}

// m, v <- the new moments of k <= W elements.
template <bool kPartial>
inline Moments moments(const Coeffs& c, const float* p, const float* g, float* m, float* v, int64_t k) {
  Vec gv = load<kPartial>(g, k);
  if (c.decay_grad) gv = at::vec::fmadd(load<kPartial>(p, k), c.wd, gv);
  const Vec mv = load<kPartial>(m, k);
  const Vec diff = gv - mv;
  const Moments r{c.w1_small ? at::vec::fmadd(c.w1, diff, mv) : at::vec::fmadd(c.w1m1, diff, gv),
                  at::vec::fmadd(c.c2 * gv, gv, load<kPartial>(v, k) * c.beta2)};
  store<kPartial>(r.m, m, k);
  store<kPartial>(r.v, v, k);
  return r;
}

// p <- the updated p of k <= W elements, given the new m and sqrt(new v).
template <bool kPartial>
inline Vec param(const Coeffs& c, float* p, const Vec& m, const Vec& sq, int64_t k) {
  Vec pv = load<kPartial>(p, k);
  if (c.decay_param) pv = pv * c.wd_scale;
  const Vec denom = sq / c.bc2_sqrt + c.eps;
  pv = (c.neg_step * m) / denom + pv;
  store<kPartial>(pv, p, k);
  return pv;
}

// out[0, a_k + b_k) <- the 16-bit copy of the W + W floats a, b.
template <typename out_t, bool kPartial>
inline void downcast(const Vec& a, const Vec& b, out_t* out, int64_t k) {
  if constexpr (!std::is_same_v<out_t, float>) {
    const auto o = at::vec::convert_from_float<out_t>(a, b);
    if (kPartial) {
      o.store(out, static_cast<int>(k));
    } else {
      o.store(out);
    }
  }
}

// The whole step for k <= 2W elements in one pass, with the vector sqrt.
template <typename out_t, bool kPartial>
inline void step_2w(const Coeffs& c, float* p, const float* g, float* m, float* v, out_t* out, int64_t k) {
  const int64_t k0 = std::min(k, W), k1 = k - k0;
  const Moments a = moments<kPartial>(c, p, g, m, v, k0);
  const Vec pa = param<kPartial>(c, p, a.m, a.v.sqrt(), k0);
  Vec pb(0.0f);
  if (!kPartial || k1 > 0) {
    const Moments b = moments<kPartial>(c, p + W, g + W, m + W, v + W, k1);
    pb = param<kPartial>(c, p + W, b.m, b.v.sqrt(), k1);
  }
  downcast<out_t, kPartial>(pa, pb, out, k);
}

// The parameter half of the step for k <= 2W elements whose moments and sqrt(v) are in memory.
template <typename out_t, bool kPartial>
inline void param_2w(const Coeffs& c, float* p, const float* m, const float* sq, out_t* out, int64_t k) {
  const int64_t k0 = std::min(k, W), k1 = k - k0;
  const Vec pa = param<kPartial>(c, p, load<kPartial>(m, k0), load<kPartial>(sq, k0), k0);
  Vec pb(0.0f);
  if (!kPartial || k1 > 0) {
    pb = param<kPartial>(c, p + W, load<kPartial>(m + W, k1), load<kPartial>(sq + W, k1), k1);
  }
  downcast<out_t, kPartial>(pa, pb, out, k);
}

// Elements [0, n) with the vector sqrt: one pass.
template <typename out_t>
void run_vector(const Coeffs& c, float* p, const float* g, float* m, float* v, out_t* out, int64_t n) {
  int64_t i = 0;
  for (; i + 2 * W <= n; i += 2 * W) {
    step_2w<out_t, false>(c, p + i, g + i, m + i, v + i, offset(out, i), 2 * W);
  }
  if (i < n) step_2w<out_t, true>(c, p + i, g + i, m + i, v + i, offset(out, i), n - i);
}

// Elements [0, n) with MKL's sqrt: per L1-resident block, moments, then vmsSqrt, then params.
template <typename out_t>
void run_vml(const Coeffs& c, float* p, const float* g, float* m, float* v, out_t* out, int64_t n) {
#if AT_MKL_ENABLED()
  alignas(64) float sq[kBlock];
  for (int64_t b = 0; b < n; b += kBlock) {
    const int64_t len = std::min(kBlock, n - b);
    int64_t i = b;
    for (; i + W <= b + len; i += W) moments<false>(c, p + i, g + i, m + i, v + i, W);
    if (i < b + len) moments<true>(c, p + i, g + i, m + i, v + i, b + len - i);
    vmsSqrt(static_cast<int>(len), v + b, sq, kVmlMode);
    int64_t j = 0;
    for (; j + 2 * W <= len; j += 2 * W) {
      param_2w<out_t, false>(c, p + b + j, m + b + j, sq + j, offset(out, b + j), 2 * W);
    }
    if (j < len) param_2w<out_t, true>(c, p + b + j, m + b + j, sq + j, offset(out, b + j), len - j);
  }
#else
  TORCH_INTERNAL_ASSERT(false, "run_vml without MKL");
#endif
}

// dst[0, n) <- float(g[0, n)) * scale: the gradient the step reads, widened from 16 bits (exact)
// and scaled in fp32 (one rounding, as `torch._foreach_mul_` of an fp32 gradient rounds).
template <typename grad_t>
inline void widen(const grad_t* g, float scale, float* dst, int64_t n) {
  if constexpr (std::is_same_v<grad_t, float>) {
    std::copy(g, g + n, dst);
  } else {
    at::vec::convert(g, dst, n);
  }
  if (scale == 1.0f) return;
  const Vec s(scale);
  int64_t i = 0;
  for (; i + W <= n; i += W) (Vec::loadu(dst + i) * s).store(dst + i);
  if (i < n) (Vec::loadu(dst + i, n - i) * s).store(dst + i, n - i);
}

template <typename out_t, typename grad_t>
void run(const Coeffs& c, bool vml, float* p, const grad_t* g, float grad_scale, float* m, float* v, out_t* out,
         int64_t numel) {
  at::parallel_for(0, numel, kGrain, [&](int64_t begin, int64_t end) {
    auto span = [&](int64_t b, int64_t n, const float* gf) {
      if (vml) {
        run_vml<out_t>(c, p + b, gf, m + b, v + b, offset(out, b), n);
      } else {
        run_vector<out_t>(c, p + b, gf, m + b, v + b, offset(out, b), n);
      }
    };
    if constexpr (std::is_same_v<grad_t, float>) {
      if (grad_scale == 1.0f) {
        span(begin, end - begin, g + begin);
        return;
      }
    }
    // a 16-bit or scaled gradient: widened block by block into L1, so DRAM sees it once, in
    // its own width (no fp32 copy of the whole gradient is allocated or written)
    alignas(64) float buf[kBlock];
    for (int64_t b = begin; b < end; b += kBlock) {
      const int64_t n = std::min(kBlock, end - b);
      widen<grad_t>(g + b, grad_scale, buf, n);
      span(b, n, buf);
    }
  });
}

template <typename out_t>
void run_any_grad(const Coeffs& c, bool vml, float* p, const at::Tensor& grad, float grad_scale, float* m, float* v,
                  out_t* out, int64_t n) {
  switch (grad.scalar_type()) {
    case at::kBFloat16:
      return run<out_t, at::BFloat16>(c, vml, p, grad.data_ptr<at::BFloat16>(), grad_scale, m, v, out, n);
    case at::kHalf:
      return run<out_t, at::Half>(c, vml, p, grad.data_ptr<at::Half>(), grad_scale, m, v, out, n);
    default:
      return run<out_t, float>(c, vml, p, grad.data_ptr<float>(), grad_scale, m, v, out, n);
  }
}

void check_state(const at::Tensor& t, const at::Tensor& param, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), "adam_step_: ", name, " must be a CPU tensor, got ", t.device());
  TORCH_CHECK(t.scalar_type() == at::kFloat, "adam_step_: ", name, " must be float32, got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), "adam_step_: ", name, " must be contiguous");
  TORCH_CHECK(t.numel() == param.numel(), "adam_step_: ", name, " has ", t.numel(),
              " elements but param has ", param.numel());
}

void adam_step_cpu(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                   const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& param16, int64_t step,
                   double lr, double beta1, double beta2, double eps, double weight_decay,
                   bool decoupled_weight_decay, bool match_torch_sqrt, double grad_scale) {
  check_state(param, param, "param");
  TORCH_CHECK(grad.device().is_cpu(), "adam_step_: grad must be a CPU tensor, got ", grad.device());
  TORCH_CHECK(grad.scalar_type() == at::kFloat || grad.scalar_type() == at::kBFloat16 ||
                  grad.scalar_type() == at::kHalf,
              "adam_step_: grad must be float32, bfloat16 or float16, got ", grad.scalar_type());
  TORCH_CHECK(grad.is_contiguous(), "adam_step_: grad must be contiguous");
  TORCH_CHECK(grad.numel() == param.numel(), "adam_step_: grad has ", grad.numel(), " elements but param has ",
              param.numel());
  TORCH_CHECK(std::isfinite(grad_scale), "adam_step_: grad_scale must be finite, got ", grad_scale);
  check_state(exp_avg, param, "exp_avg");
  check_state(exp_avg_sq, param, "exp_avg_sq");
  TORCH_CHECK(step >= 1, "adam_step_: step is the step number after this update and must be >= 1, got ", step);
  TORCH_CHECK(lr >= 0.0, "adam_step_: lr must be >= 0, got ", lr);
  TORCH_CHECK(0.0 <= beta1 && beta1 < 1.0, "adam_step_: beta1 must be in [0, 1), got ", beta1);
  TORCH_CHECK(0.0 <= beta2 && beta2 < 1.0, "adam_step_: beta2 must be in [0, 1), got ", beta2);
  TORCH_CHECK(eps >= 0.0, "adam_step_: eps must be >= 0, got ", eps);
  TORCH_CHECK(weight_decay >= 0.0, "adam_step_: weight_decay must be >= 0, got ", weight_decay);
  if (param16.has_value()) {
    const at::Tensor& o = *param16;
    TORCH_CHECK(o.device().is_cpu(), "adam_step_: param16 must be a CPU tensor, got ", o.device());
    TORCH_CHECK(o.scalar_type() == at::kBFloat16 || o.scalar_type() == at::kHalf,
                "adam_step_: param16 must be bfloat16 or float16, got ", o.scalar_type());
    TORCH_CHECK(o.is_contiguous(), "adam_step_: param16 must be contiguous");
    TORCH_CHECK(o.numel() == param.numel(), "adam_step_: param16 has ", o.numel(),
                " elements but param has ", param.numel());
  }
  const std::pair<const at::Tensor*, const char*> tensors[] = {
      {&param, "param"}, {&grad, "grad"}, {&exp_avg, "exp_avg"}, {&exp_avg_sq, "exp_avg_sq"},
      {param16.has_value() ? &*param16 : nullptr, "param16"}};
  for (size_t i = 0; i < std::size(tensors); ++i) {
    for (size_t j = i + 1; j < std::size(tensors); ++j) {
      if (tensors[i].first == nullptr || tensors[j].first == nullptr) continue;
      const auto overlap = at::get_overlap_status(*tensors[i].first, *tensors[j].first);
      TORCH_CHECK(overlap != at::MemOverlapStatus::Full && overlap != at::MemOverlapStatus::Partial,
                  "adam_step_: ", tensors[i].second, " and ", tensors[j].second,
                  " share memory; each must be a tensor of its own");
    }
  }

  // Scalars exactly as torch/optim/adam.py computes them (Python floats are doubles).
  const double bc1 = 1.0 - std::pow(beta1, static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(beta2, static_cast<double>(step));
  const bool has_wd = weight_decay != 0.0;
  const float w1 = static_cast<float>(1.0 - beta1);
  Coeffs c{decoupled_weight_decay && has_wd,
           !decoupled_weight_decay && has_wd,
           std::abs(w1) < 0.5f,
           Vec(static_cast<float>(1.0 - lr * weight_decay)),
           Vec(static_cast<float>(weight_decay)),
           Vec(w1),
           Vec(w1 - 1.0f),
           Vec(static_cast<float>(beta2)),
           Vec(static_cast<float>(1.0 - beta2)),
           Vec(static_cast<float>(std::pow(bc2, 0.5))),
           Vec(static_cast<float>(eps)),
           Vec(static_cast<float>(-(lr / bc1)))};
  const bool vml = kHaveVml && match_torch_sqrt;

  float* p = param.data_ptr<float>();
  float* m = exp_avg.data_ptr<float>();
  float* v = exp_avg_sq.data_ptr<float>();
  const int64_t n = param.numel();
  const float scale = static_cast<float>(grad_scale);
  if (!param16.has_value()) {
    run_any_grad<float>(c, vml, p, grad, scale, m, v, nullptr, n);
  } else if (param16->scalar_type() == at::kBFloat16) {
    run_any_grad<at::BFloat16>(c, vml, p, grad, scale, m, v, param16->data_ptr<at::BFloat16>(), n);
  } else {
    run_any_grad<at::Half>(c, vml, p, grad, scale, m, v, param16->data_ptr<at::Half>(), n);
  }
}

std::string kernel_info() {
  return std::string("Vectorized<float> width ") + std::to_string(W) + ", torch's sqrt is " +
         (kHaveVml ? "MKL vmsSqrt (VML_HA)" : "the vector sqrt") + ", " + std::to_string(at::get_num_threads()) +
         " threads";
}

}  // namespace

TORCH_LIBRARY(tensorstow, m) {
  m.def("adam_step_(Tensor(a!) param, Tensor grad, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, "
        "Tensor(d!)? param16, int step, float lr, float beta1, float beta2, float eps, "
        "float weight_decay, bool decoupled_weight_decay, bool match_torch_sqrt, float grad_scale=1.0) -> ()");
  m.def("adam_kernel_info() -> str", &kernel_info);
}

TORCH_LIBRARY_IMPL(tensorstow, CPU, m) {
  m.impl("adam_step_", &adam_step_cpu);
}
