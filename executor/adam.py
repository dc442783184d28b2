"""CPU Adam/AdamW step that also writes the fp16/bf16 copy of the parameters.

    adamw_step_(p32, grad, m, v, step, lr, betas, eps, wd, out16=None, *, decoupled=True, exact=False)
    kernel_info() -> str

One call updates the fp32 master parameters `p32` and the moments `m`, `v` in place and, when
`out16` (bf16 or fp16, same numel) is given, writes `p32.to(out16.dtype)` into it: what a
mixed-precision CPU optimizer hands back to the device. `step` is the step number after this
update (1 on the first call), as in `torch.optim.AdamW`'s state. `decoupled=False` gives Adam
(L2: grad + wd * p) instead of AdamW.

Engines: the C++ kernel (csrc/adam.cpp) does the update and the downcast in one pass over
memory; when it cannot be built, a torch fallback runs a torch step, then `out16.copy_(p32)`.

* exact=True: bit-identical to `torch.optim.AdamW(foreach=False)` (`Adam` for decoupled=False)
  + `copy_`, on either engine (the kernel runs torch's op order and torch's own sqrt, MKL's
  vmsSqrt; the fallback runs torch's single-tensor step).
* exact=False (default, fast): the kernel runs the same op order with a correctly rounded sqrt.
  torch's MKL sqrt is 1 ulp off for ~16% of inputs on this CPU, so params may differ from
  torch's in the last bit (tests: rtol 2**-22); the fallback runs torch's fused kernel
  (`torch._fused_adamw_`, what `AdamW(fused=True)` runs), equally close.

Why a kernel and not torch's fused AdamW + a separate cast: one pass over memory instead of two.
For a purely bandwidth-bound update the floor of the gain is 34/30 = 1.13x (fused step 28 B/param
+ cast 6 B vs 30 B in one pass); the kernel stays as long as it clears 1.1x on both of
`benchmarks/bench_adam.py`'s sizes (benchmarks/RESULTS.md "CPU Adam"). exact=True is not the fast
path.

`load_kernel()` JIT-builds the kernel once (cached next to the aio engine: under
$TENSORSTOW_CACHE, else $TORCH_EXTENSIONS_DIR/tensorstow, else ~/.cache/tensorstow); a failed
build is remembered for the process and the steps fall back to torch. `kernel_info()` says
which engine is active and why. `execute --cpu-adam torch` forces the fallback, `--cpu-adam cpp`
makes a failed build an error (`kernel_choice`).
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from tensorstow.errors import TensorstowError
from tensorstow.executor import aio
from tensorstow.schema.options import check_values

_CSRC = Path(__file__).resolve().parent.parent / "csrc" / "adam.cpp"
_EXT_NAME = "tensorstow_adam"
_FALLBACK = "torch fallback (fused step + copy_; exact=True: single-tensor step + copy_)"

_lock = threading.Lock()
_loaded = False
_load_error: RuntimeError | None = None  # a failed build, not retried in this process
_kernel_status = ""  # what load_kernel() loaded, and from where
_status: str | None = None  # why the active engine is the one it is


def cache_dir() -> Path:
    """Where the C++ kernel is built and cached (beside the aio engine's build)."""
    return aio.ext_cache_dir(_EXT_NAME, _CSRC)


def _cflags() -> list[str]:
    # -ffp-contract=off: GCC would otherwise contract a multiply and an add that are separate
    # ATen ops in torch's step into one FMA; the FMAs ATen does use are written out
    # (at::vec::fmadd). The ISA flags are those of ATen's AVX2 kernels, so Vectorized<float> is
    # the 8-wide AVX2 class; torch keys the cached build on the flags.
    flags = ["-O3", "-ffp-contract=off", "-fopenmp"]
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        flags += ["-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2", "-mavx2", "-mfma", "-mf16c", "-mbmi",
                  "-mbmi2"]
    return flags


def load_kernel() -> None:
    """Builds (~50 s, once) or loads the C++ kernel and registers `torch.ops.tensorstow.adam_step_`.

    Raises RuntimeError (with the compiler's message) when it cannot be built; a failed build
    is not retried in the same process. Thread-safe; concurrent processes are serialized by
    `aio.compile_extension`'s lock.
    """
    global _loaded, _load_error, _kernel_status
    with _lock:
        if _loaded:
            return
        if _load_error is not None:
            raise _load_error
        try:
            # is_python_module=False: the library registers its ops (TORCH_LIBRARY) on load.
            _, build_dir = aio.compile_extension(_EXT_NAME, _CSRC, extra_cflags=_cflags(),
                                                 extra_ldflags=["-fopenmp"], is_python_module=False)
        except Exception as e:  # the compiler, ninja, the loader or the disk: all mean "no C++ kernel"
            _load_error = RuntimeError(f"building the C++ Adam kernel from {_CSRC} in {cache_dir()} failed: "
                                       f"{aio.first_error_line(e)}")
            raise _load_error from e

        @torch.library.register_fake("tensorstow::adam_step_")
        def _(param, grad, exp_avg, exp_avg_sq, param16, step, lr, beta1, beta2, eps, weight_decay,
              decoupled_weight_decay, match_torch_sqrt, grad_scale=1.0):
            return None  # updates its inputs in place; nothing to allocate

        _loaded = True
        _kernel_status = (f"C++ kernel (tensorstow_adam: {torch.ops.tensorstow.adam_kernel_info()}), "
                          f"built/cached in {build_dir}")


KERNELS = ("auto", "cpp", "torch")
kernel_choice = "auto"
"""Which CPU update runs (`execute --cpu-adam`): cpp, the fused C++ kernel (built on first use; a
failed build is an error); torch, torch's own AdamW; auto, cpp where it builds."""


def _use_kernel() -> bool:
    """Whether steps run in the C++ kernel (loads it on first use)."""
    global _status
    choice = kernel_choice
    if choice not in KERNELS:
        raise TensorstowError(f"CPU Adam {choice!r}: use {', '.join(KERNELS)}")
    if choice == "torch":
        _status = f"{_FALLBACK}: --cpu-adam torch"
        return False
    try:
        load_kernel()
    except RuntimeError as e:
        if choice == "cpp":
            raise
        _status = f"{_FALLBACK}: {e}"
        return False
    _status = _kernel_status
    return True


GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""What a gradient may be: fp32, or the 16-bit gradient of a mixed-precision step, which the
update reads in its own width and widens exactly (the step equals one on `grad.float()`)."""


def _check(p32, grad, m, v, step, lr, betas, eps, wd, out16) -> None:
    for name, t in (("p32", p32), ("grad", grad), ("m", m), ("v", v)):
        ok = (torch.float32,) if name != "grad" else GRAD_DTYPES
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or t.dtype not in ok:
            raise ValueError(f"adamw_step_: {name} must be a {'float32' if name != 'grad' else 'float32/bfloat16/float16'} CPU tensor, got "
                             f"{getattr(t, 'dtype', type(t).__name__)} on {getattr(t, 'device', '?')}")
        if not t.is_contiguous():
            raise ValueError(f"adamw_step_: {name} must be contiguous")
        if t.numel() != p32.numel():
            raise ValueError(f"adamw_step_: {name} has {t.numel()} elements but p32 has {p32.numel()}")
    if out16 is not None:
        if out16.device.type != "cpu" or out16.dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"adamw_step_: out16 must be a bfloat16 or float16 CPU tensor, got {out16.dtype} "
                             f"on {out16.device}")
        if not out16.is_contiguous() or out16.numel() != p32.numel():
            raise ValueError(f"adamw_step_: out16 must be contiguous with {p32.numel()} elements (p32's), got "
                             f"{out16.numel()}")
    # All contiguous: two overlap iff their byte ranges do (slices of one flat buffer are fine).
    named = [("p32", p32), ("grad", grad), ("m", m), ("v", v)] + ([("out16", out16)] if out16 is not None else [])
    spans = [(name, t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for name, t in named]
    for i, (a_name, a_start, a_end) in enumerate(spans):
        for b_name, b_start, b_end in spans[i + 1:]:
            if a_start < b_end and b_start < a_end:
                raise ValueError(f"adamw_step_: {a_name} and {b_name} share memory; each must be a tensor of its own")
    _check_scalars(step, lr, betas, eps, wd)


def _check_scalars(step, lr, betas, eps, wd) -> None:
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"adamw_step_: step is the step number after this update (an int >= 1), got {step!r}")
    beta1, beta2 = betas
    if not (lr >= 0 and 0 <= beta1 < 1 and 0 <= beta2 < 1 and eps >= 0 and wd >= 0):
        raise ValueError(f"adamw_step_: need lr >= 0, 0 <= betas < 1, eps >= 0, wd >= 0; got lr={lr}, "
                         f"betas={betas}, eps={eps}, wd={wd}")


def _single_tensor_step_(p32, grad, m, v, step, lr, beta1, beta2, eps, wd, decoupled) -> None:
    """torch/optim/adam.py's `_single_tensor_adam` for one tensor (no amsgrad/maximize), op for op."""
    if wd != 0:
        if decoupled:
            p32.mul_(1 - lr * wd)
        else:
            grad = grad.add(p32, alpha=wd)
    m.lerp_(grad, 1 - beta1)
    v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = lr / bias_correction1
    denom = (v.sqrt() / bias_correction2**0.5).add_(eps)
    p32.addcdiv_(m, denom, value=-step_size)


def _fused_step_(p32, grad, m, v, step, lr, beta1, beta2, eps, wd, decoupled) -> None:
    """torch's fused CPU Adam/AdamW kernel (what `AdamW(fused=True)` runs)."""
    fused = torch._fused_adamw_ if decoupled else torch._fused_adam_
    fused([p32], [grad], [m], [v], [], [torch.tensor(float(step))], lr=lr, beta1=beta1, beta2=beta2,
          weight_decay=wd, eps=eps, amsgrad=False, maximize=False)


def adamw_step_(p32: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: int,
                lr: float, betas: tuple[float, float], eps: float, wd: float,
                out16: torch.Tensor | None = None, *, decoupled: bool = True, exact: bool = False,
                grad_scale: float = 1.0) -> None:
    """One AdamW (decoupled=True) or Adam step of `p32`, `m`, `v` in place; `out16` <- p32 in 16 bit.

    All of p32, grad, m, v: contiguous CPU tensors with the same numel, float32 but `grad`, which
    may be 16-bit (`GRAD_DTYPES`) and is only read. `grad_scale`: the step reads the gradient
    times it (in fp32, as clip_grad_norm_'s in-place multiply). `exact=True`: bit-identical to
    torch.optim.AdamW/Adam(foreach=False) (slower where torch's sqrt is MKL's). Raises ValueError
    naming the bad argument.
    """
    _check(p32, grad, m, v, step, lr, betas, eps, wd, out16)
    if _use_kernel():
        torch.ops.tensorstow.adam_step_(p32, grad, m, v, out16, step, float(lr), float(betas[0]), float(betas[1]),
                                        float(eps), float(wd), decoupled, exact, float(grad_scale))
        return
    grad = _widened(grad, grad_scale)
    args = (p32, grad, m, v, step, float(lr), float(betas[0]), float(betas[1]), float(eps), float(wd))
    if exact:
        _single_tensor_step_(*args, decoupled)
    else:
        _fused_step_(*args, decoupled)
    if out16 is not None:
        out16.copy_(p32)


def _widened(grad: torch.Tensor, scale: float) -> torch.Tensor:
    """`grad` as the fp32 gradient the step reads: widened from 16 bits, times `scale` in fp32."""
    if grad.dtype != torch.float32:
        grad = grad.float()
    elif scale != 1.0:
        grad = grad.clone()
    if scale != 1.0:
        grad.mul_(torch.tensor(scale, dtype=torch.float32))
    return grad


def adamw_steps_(params, grads, ms, vs, step: int, lr: float, betas: tuple[float, float], eps: float,
                 wd: float, out16s=None, *, decoupled: bool = True, grad_scale: float = 1.0) -> None:
    """`adamw_step_` (exact=False) over a subgroup's tensors, for the executor's hot loop: the
    engine is chosen once and the per-tensor checks are reduced to what can differ between the
    executor's tensors (contiguity: a tensor stored with a kept stride goes through torch's
    fused kernel instead). Same results as `adamw_step_` tensor by tensor; `grads` may be 16-bit
    and are read times `grad_scale`, never written."""
    if not params:
        return
    _check_scalars(step, lr, betas, eps, wd)
    for name, ts in (("params", params), ("grads", grads), ("exp_avg", ms), ("exp_avg_sq", vs)):
        ok = GRAD_DTYPES if name == "grads" else (torch.float32,)
        if any(t.dtype not in ok or t.device.type != "cpu" for t in ts):
            raise ValueError(f"adamw_steps_: {name} must be {'float32/bfloat16/float16' if name == 'grads' else 'float32'} "
                             f"CPU tensors")
    args = (step, float(lr), float(betas[0]), float(betas[1]), float(eps), float(wd))
    kernel = torch.ops.tensorstow.adam_step_ if _use_kernel() else None
    rest = []
    for k, (p, g, m, v) in enumerate(zip(params, grads, ms, vs)):
        o = out16s[k] if out16s else None
        if kernel is not None and p.is_contiguous() and g.is_contiguous() and m.is_contiguous() \
                and v.is_contiguous() and (o is None or o.is_contiguous()):
            kernel(p, g, m, v, o, *args, decoupled, False, float(grad_scale))
        else:
            rest.append(k)
    if rest:  # no kernel, or a strided tensor: torch's fused multi-tensor step, then the cast
        fused = torch._fused_adamw_ if decoupled else torch._fused_adam_
        fused([params[k] for k in rest], [_widened(grads[k], grad_scale) for k in rest], [ms[k] for k in rest],
              [vs[k] for k in rest],
              [], [torch.tensor(float(step)) for _ in rest], lr=float(lr), beta1=float(betas[0]),
              beta2=float(betas[1]), weight_decay=float(wd), eps=float(eps), amsgrad=False, maximize=False)
        for k in rest:
            if out16s and out16s[k] is not None:
                out16s[k].copy_(params[k])


def kernel_info() -> str:
    """Which engine `adamw_step_` uses and why (builds or loads the C++ kernel if needed)."""
    _use_kernel()
    return f"adam: {_status}"


class SubgroupAdam:
    """Adam/AdamW of one subgroup, on the tier copies of its tensors.

    exact (plan option `exact_optimizer`): one torch.optim.Adam/AdamW(foreach=False), pointed at
    the tier copies every step: bit-identical with eager's default CPU path. Otherwise the fast
    update: CPU tensors go through `executor.adam.adamw_step_` (csrc/adam.cpp: one pass over
    memory, the fresh 16-bit compute copy written in it; torch's fused kernel if the C++ build
    is unavailable), device tensors through torch's fused multi-tensor kernel. Both differ from
    torch's single-tensor step only in the rounding of sqrt (a correctly rounded one instead
    of MKL's, 1 ulp off for some inputs), see `executor/adam.py`.
    """

    def __init__(self, options):
        kind = options.optimizer
        if kind not in ("adam", "adamw"):
            raise TensorstowError(f"plan options: unknown optimizer '{kind}' (adam or adamw)")
        check_values(options)  # a plan file edited by hand: one line, not the kernel's ValueError
        self.exact = options.exact_optimizer
        self.decoupled = kind == "adamw"
        self.lr, self.betas, self.eps, self.wd = options.lr, tuple(options.betas), options.eps, options.weight_decay
        if self.exact:
            cls = torch.optim.AdamW if self.decoupled else torch.optim.Adam
            self.opt = cls([torch.zeros(1)], lr=self.lr, betas=self.betas, eps=self.eps,
                           weight_decay=self.wd, foreach=False)

    def step(self, params, grads, moments, steps_done: int | torch.Tensor, out16=None, groups=None, lr_of=None,
             grad_scale: float = 1.0, rates: dict[float, torch.Tensor] | None = None) -> None:
        """One update of `params` (fp32) from `grads`; `steps_done` updates came before it.
        `out16`: per parameter, a 16-bit tensor to receive its updated value (fast CPU path).
        `grad_scale`: the gradients are read times it (fast CPU path, whose `grads` may be 16-bit:
        `adamw_steps_`); other paths take it as 1 and their gradients clipped already.
        `groups`: per parameter, its group's (learning rate scale, weight decay) (default: (1,
        the options' weight decay) for all), as torch.optim's parameter groups: one update per
        group. `lr_of(scale)`: a group's learning rate (default: `lr` x scale).
        `rates` (a step captured as a graph, executor.graphs): per group lr scale, a device tensor
        holding its rate, and `steps_done` a device tensor holding this update's number; torch's
        fused kernel reads both from memory, so a replay takes the values they hold then."""
        if not params:
            return
        if groups is None:
            groups = [(1.0, self.wd)] * len(params)
        for scale, wd in dict.fromkeys(groups):
            at = [k for k, g in enumerate(groups) if g == (scale, wd)]
            lr = (rates[scale] if rates is not None else self.lr if scale == 1.0
                  else lr_of(scale) if lr_of is not None else self.lr * scale)
            if len(at) == len(params):
                return self._update(params, grads, moments, steps_done, out16, wd, lr, grad_scale)
            self._update([params[k] for k in at], [grads[k] for k in at], [moments[k] for k in at], steps_done,
                         None if out16 is None else [out16[k] for k in at], wd, lr, grad_scale)

    def _update(self, params, grads, moments, steps_done: int | torch.Tensor, out16, wd: float,
                lr: float | torch.Tensor, grad_scale: float = 1.0) -> None:
        if params[0].device.type == "cpu" and not self.exact and not isinstance(lr, torch.Tensor):
            adamw_steps_(params, grads, [m for m, _ in moments], [v for _, v in moments], steps_done + 1,
                         lr, self.betas, self.eps, wd, out16, decoupled=self.decoupled, grad_scale=grad_scale)
            return
        if grad_scale != 1.0 or any(g.dtype != p.dtype for p, g in zip(params, grads)):
            raise ValueError("SubgroupAdam: a scaled or 16-bit gradient needs the fast CPU update")
        if self.exact:
            return self._torch_step(params, grads, moments, steps_done, wd, lr)
        fused = torch._fused_adamw_ if self.decoupled else torch._fused_adam_
        step = (steps_done if isinstance(steps_done, torch.Tensor)  # no host copy
                else torch.full((), float(steps_done + 1), dtype=torch.float32, device=params[0].device))
        steps = [step] * len(params)  # read, not written, by the fused kernel
        grads = [g if g.stride() == p.stride() else torch.empty_like(p).copy_(g) for p, g in zip(params, grads)]
        fused(params, grads, [m for m, _ in moments], [v for _, v in moments], [], steps,
              lr=lr, beta1=self.betas[0], beta2=self.betas[1], weight_decay=wd, eps=self.eps,
              amsgrad=False, maximize=False)

    def _torch_step(self, params, grads, moments, steps_done: int, wd: float, lr: float) -> None:
        from torch.optim.optimizer import _get_scalar_dtype

        group = self.opt.param_groups[0]
        group["params"], group["weight_decay"], group["lr"] = params, wd, lr
        self.opt.state.clear()
        try:
            for p, g, (m, v) in zip(params, grads, moments):
                p.grad = g
                self.opt.state[p] = {"step": torch.tensor(float(steps_done), dtype=_get_scalar_dtype()),
                                     "exp_avg": m, "exp_avg_sq": v}
            self.opt.step()
        finally:
            for p in params:
                p.grad = None
            self.opt.state.clear()
            group["params"] = []
