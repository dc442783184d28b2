"""CUDA's autocast policy, applied to CPU tensors: how a mixed-precision plan's ops get their dtypes.

A plan is for a GPU, so each op must run in the dtype `torch.autocast("cuda", dtype)` gives it
(matmuls and attention in bf16/fp16; norms, softmax, exp/log/pow, reductions and losses in fp32)
— but the planner traces on CPU fake tensors, where a CPU-only torch has no CUDA autocast and
CPU autocast follows a different list (it keeps layer_norm and softmax in bf16). `gpu_autocast`
enables CPU autocast with CUDA's op lists: for its duration it registers, at the AutocastCPU
dispatch key, one Python kernel per op of CUDA's lists (the casts `at::autocast` makes for the
CUDA key: `lower_precision_fp`, `fp32`, `fp32_set_opt_dtype`, `promote`) and a fallthrough for
the ops only CPU's list casts. The casts are dispatched like C++ autocast's, above autograd, so
the joint graph records them (`aten._to_copy`) with their backward, and an eager model run
inside `gpu_autocast` computes the same ops in the same dtypes.

Source of the lists: `aten/src/ATen/autocast_mode.h` (AT_FORALL_LOWER_PRECISION_FP,
AT_FORALL_FP32, AT_FORALL_FP32_SET_OPT_DTYPE, AT_FORALL_PROMOTE; CUDA registers all four) and
`autocast_mode.cpp` (the AutocastCPU list), torch 2.13. `tests/test_executor_cuda.py` checks
the table against real CUDA autocast when a GPU is present.
"""
from __future__ import annotations

import contextlib
import threading
import warnings
import weakref

import torch

LOWER_PRECISION_FP = (
    "_convolution.deprecated", "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d",
    "conv_transpose2d.input", "conv_transpose3d.input", "convolution", "prelu", "addmm", "addmv", "addr",
    "matmul", "einsum", "mm", "mv", "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm", "chain_matmul",
    "linalg_multi_dot", "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell", "gru_cell",
    "rnn_tanh_cell", "rnn_relu_cell", "_scaled_dot_product_flash_attention", "scaled_dot_product_attention")
"""Ops CUDA autocast runs in the lower precision (every floating input cast to it)."""

FP32 = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
    "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus", "layer_norm",
    "native_layer_norm", "group_norm", "frobenius_norm.dim", "nuclear_norm", "nuclear_norm.dim",
    "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d",
    "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss",
    "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss",
    "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp",
    "upsample_nearest1d", "_upsample_nearest_exact1d", "upsample_nearest2d", "_upsample_nearest_exact2d",
    "upsample_nearest3d", "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d",
    "_upsample_bilinear2d_aa", "upsample_trilinear3d", "upsample_bicubic2d", "_upsample_bicubic2d_aa")
"""Ops CUDA autocast runs in fp32 (every floating input cast to fp32)."""

FP32_SET_OPT_DTYPE = (
    "prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum", "linalg_vector_norm",
    "linalg_matrix_norm", "linalg_matrix_norm.str_ord", "sum", "sum.dim_IntList")
"""Ops with an optional `dtype` argument: fp32 output unless the caller gave a dtype."""

PROMOTE = ("addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler", "index_put",
           "tensordot", "scatter_add")
"""Ops whose floating inputs are cast to the widest floating dtype among them."""

_CPU_ONLY = ("conv1d.padding", "conv2d.padding", "conv3d.padding", "_addmm_activation", "mkldnn_rnn_layer",
             "_native_multi_head_attention", "avg_pool3d", "binary_cross_entropy", "grid_sampler_2d",
             "_grid_sampler_2d_cpu_fallback", "grid_sampler_3d", "polar", "quantile", "quantile.scalar",
             "nanquantile", "nanquantile.scalar", "stft", "stft.center", "trace", "view_as_complex",
             "max_pool3d", "max_unpool2d", "max_unpool3d", "adaptive_avg_pool3d", "reflection_pad1d",
             "reflection_pad2d", "replication_pad1d", "replication_pad2d", "replication_pad3d",
             "cross_entropy_loss", "stack", "cat", "index_copy")
"""Ops CPU autocast casts and CUDA's does not (CUDA lets them run in their inputs' dtype; the
loss of `cross_entropy` still comes out fp32: its log_softmax and nll_loss are on CUDA's lists).
Only the ones a transformer can meet are listed; the linear-algebra and FFT ops CPU keeps in
fp32 are fp32-only on CUDA too."""

_KEY = torch._C.DispatchKey.AutocastCPU
_LOCK = threading.RLock()
_ACTIVE: list = []  # the open region's policy (regions nest in one thread, never run in two)


class _Policy:
    """The kernels of one `gpu_autocast` region and its cache of cast weights (like C++
    autocast's: a leaf fp32 tensor that requires grad is cast once per region, so a weight read
    twice has one cast and one gradient)."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self.cache: dict[int, tuple] = {}

    def cast(self, x, to: torch.dtype):
        if not (isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != torch.float64):
            return x
        if x.dtype == to:
            return x
        if to == self.dtype and x.is_leaf and x.requires_grad and x.dtype == torch.float32:  # C++: lower precision only
            hit = self.cache.get(id(x))
            if hit is not None and hit[0]() is x:
                return hit[1]
            out = x.to(to)
            self.cache[id(x)] = (weakref.ref(x), out)
            return out
        return x.to(to)

    def kernel(self, op, policy: str):
        def run(*args, **kwargs):
            if policy == "fp32_set_opt_dtype":
                first = next((a for a in args if isinstance(a, torch.Tensor)), None)
                if (first is not None and first.is_floating_point() and first.dtype != torch.float64
                        and kwargs.get("dtype") is None and not _has_dtype_arg(op, args)):
                    kwargs = {**kwargs, "dtype": torch.float32}
            else:
                if policy == "promote":
                    to = _widest(args, kwargs)
                else:  # the innermost autocast region's dtype (model code may nest one)
                    to = torch.get_autocast_dtype("cpu") if policy == "lower" else torch.float32
                if to is not None:
                    args = tuple(self._cast_tree(a, to) for a in args)
                    kwargs = {k: self._cast_tree(v, to) for k, v in kwargs.items()}
            with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(_KEY)):
                return op(*args, **kwargs)
        return run

    def _cast_tree(self, a, to):
        if isinstance(a, (list, tuple)):
            return type(a)(self.cast(x, to) for x in a)
        return self.cast(a, to)


def _widest(args, kwargs):
    floats = [t for t in torch.utils._pytree.tree_leaves((args, kwargs))
              if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64]
    if not floats:
        return None
    return max((t.dtype for t in floats), key=lambda d: torch.finfo(d).bits)


def _has_dtype_arg(op, args) -> bool:
    """A positional `dtype` given (softmax(x, dim, torch.float16)): the caller's choice stands."""
    for k, a in enumerate(op._schema.arguments):
        if a.name == "dtype":
            return k < len(args) and args[k] is not None
    return False


def _overload(name: str):
    base, _, ov = name.partition(".")
    return getattr(getattr(torch.ops.aten, base), ov or "default")


@contextlib.contextmanager
def gpu_autocast(dtype: torch.dtype):
    """`torch.autocast` with CUDA's op lists, on CPU tensors (see the module doc). One region at
    a time per process: the kernels are registered globally while it is open, so another thread
    that enables CPU autocast meanwhile gets CUDA's lists too (tensorstow traces on one thread)."""
    with _LOCK:
        if _ACTIVE:  # nested: the kernels are in place; only the dtype may differ
            if _ACTIVE[-1].dtype != dtype:
                raise ValueError(f"gpu_autocast({dtype}) inside gpu_autocast({_ACTIVE[-1].dtype})")
            with torch.autocast("cpu", dtype=dtype, cache_enabled=False):
                yield _ACTIVE[-1]
            return
        policy = _Policy(dtype)
        _ACTIVE.append(policy)
        lib = torch.library.Library("aten", "IMPL")
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*Overriding a previously registered kernel.*")
                warnings.filterwarnings("ignore", message=".*operators may also be overridden.*")
                for names, kind in ((LOWER_PRECISION_FP, "lower"), (FP32, "fp32"),
                                    (FP32_SET_OPT_DTYPE, "fp32_set_opt_dtype"), (PROMOTE, "promote")):
                    for name in names:
                        lib.impl(name, policy.kernel(_overload(name), kind), "AutocastCPU")
                for name in _CPU_ONLY:
                    lib.impl(name, torch.library.fallthrough_kernel, "AutocastCPU")
            with torch.autocast("cpu", dtype=dtype, cache_enabled=False):
                yield policy
        finally:
            _ACTIVE.pop()
            policy.cache.clear()
            lib._destroy()
