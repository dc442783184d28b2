"""executor/adam.py and csrc/adam.cpp against torch.optim.Adam/AdamW(foreach=False).

exact=True must be bit-identical to torch. exact=False (the default) must be bit-identical to
torch's single-tensor op order with a correctly rounded sqrt (numpy's), which differs from
torch's own Tensor.sqrt (MKL VML) by 1 ulp for some inputs; against torch itself that leaves
at most a last-bit difference per step (rtol 2**-22 below).

The C++ tests build the kernel (~50 s the first time, then cached) and skip, with the
compiler's message, when it cannot be built.
"""

import numpy as np
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from tensorstow.errors import TensorstowError
from tensorstow.executor import adam

STEPS = 5
# (optimizer, decoupled, weight decay, betas): both lerp branches (1 - beta1 < 0.5 and >= 0.5),
# with and without weight decay.
CONFIGS = [
    (torch.optim.AdamW, True, 0.01, (0.9, 0.999)),
    (torch.optim.AdamW, True, 0.1, (0.3, 0.99)),
    (torch.optim.AdamW, True, 0.0, (0.9, 0.999)),
    (torch.optim.Adam, False, 0.01, (0.9, 0.999)),
    (torch.optim.Adam, False, 0.0, (0.5, 0.9)),
]
# Sizes: single element, below one vector, one vector + tail, multi-threaded with odd tails.
SIZES = [1, 7, 17, 1000, 65537, 300007]


@pytest.fixture(scope="module")
def kernel():
    try:
        adam.load_kernel()
    except RuntimeError as e:
        pytest.skip(f"C++ Adam kernel unavailable: {e}")


def reference(n, opt_cls, wd, betas, lr=1e-3, eps=1e-8, seed=0):
    """Initial params, the gradients of each step, and torch's optimizer after STEPS steps."""
    gen = torch.Generator().manual_seed(seed)
    p0 = torch.randn(n, generator=gen)
    grads = [torch.randn(n, generator=gen) * 0.1 for _ in range(STEPS)]
    ref = p0.clone().requires_grad_(True)
    opt = opt_cls([ref], lr=lr, betas=betas, eps=eps, weight_decay=wd, foreach=False)
    for g in grads:
        ref.grad = g.clone()
        opt.step()
    return p0, grads, ref.detach(), opt.state[ref]


def correctly_rounded_reference(p0, grads, decoupled, wd, betas, lr=1e-3, eps=1e-8):
    """torch's `_single_tensor_adam` op for op, with numpy's correctly rounded float32 sqrt."""
    beta1, beta2 = betas
    p, m, v = p0.clone(), torch.zeros_like(p0), torch.zeros_like(p0)
    for step, grad in enumerate(grads, start=1):
        if wd != 0:
            if decoupled:
                p.mul_(1 - lr * wd)
            else:
                grad = grad.add(p, alpha=wd)
        m.lerp_(grad, 1 - beta1)
        v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        denom = (torch.from_numpy(np.sqrt(v.numpy())) / (1 - beta2**step) ** 0.5).add_(eps)
        p.addcdiv_(m, denom, value=-(lr / (1 - beta1**step)))
    return p, {"exp_avg": m, "exp_avg_sq": v}


def run_ours(p0, grads, decoupled, wd, betas, dtype, exact, lr=1e-3, eps=1e-8):
    p, m, v = p0.clone(), torch.zeros_like(p0), torch.zeros_like(p0)
    out16 = torch.empty(p0.numel(), dtype=dtype) if dtype is not None else None
    for step, g in enumerate(grads, start=1):
        g_in = g.clone()
        adam.adamw_step_(p, g_in, m, v, step, lr, betas, eps, wd, out16, decoupled=decoupled, exact=exact)
        assert torch.equal(g_in, g), "grad must be read only"
    return p, m, v, out16


def assert_bit_identical(p, m, v, out16, ref_p, state):
    assert torch.equal(p, ref_p), f"params differ at {(p != ref_p).sum().item()} of {p.numel()} elements"
    assert torch.equal(m, state["exp_avg"])
    assert torch.equal(v, state["exp_avg_sq"])
    if out16 is not None:
        assert torch.equal(out16, p.to(out16.dtype))


@pytest.mark.parametrize("opt_cls,decoupled,wd,betas", CONFIGS)
@pytest.mark.parametrize("n", [1, 17, 1000])
def test_torch_fallback(monkeypatch, opt_cls, decoupled, wd, betas, n):
    """exact=True: torch's single-tensor step, bit for bit; exact=False: torch's fused kernel, close."""
    monkeypatch.setattr(adam, "kernel_choice", "torch")
    p0, grads, ref_p, state = reference(n, opt_cls, wd, betas)
    assert_bit_identical(*run_ours(p0, grads, decoupled, wd, betas, torch.bfloat16, True), ref_p, state)
    p, m, v, out16 = run_ours(p0, grads, decoupled, wd, betas, torch.float16, False)
    torch.testing.assert_close(p, ref_p, rtol=2**-21, atol=1e-9)
    torch.testing.assert_close(v, state["exp_avg_sq"], rtol=2**-21, atol=0.0)
    assert torch.equal(out16, p.half())
    assert "torch fallback" in adam.kernel_info() and "--cpu-adam torch" in adam.kernel_info()


@pytest.mark.parametrize("opt_cls,decoupled,wd,betas", CONFIGS)
@pytest.mark.parametrize("n", SIZES)
def test_kernel_exact_bit_identical_to_torch(kernel, monkeypatch, opt_cls, decoupled, wd, betas, n):
    monkeypatch.setattr(adam, "kernel_choice", "cpp")
    p0, grads, ref_p, state = reference(n, opt_cls, wd, betas, seed=n)
    for dtype in (None, torch.bfloat16, torch.float16):
        assert_bit_identical(*run_ours(p0, grads, decoupled, wd, betas, dtype, True), ref_p, state)
    assert "C++ kernel" in adam.kernel_info()


@pytest.mark.parametrize("opt_cls,decoupled,wd,betas", CONFIGS)
@pytest.mark.parametrize("n", SIZES)
def test_kernel_default_is_torch_order_with_rounded_sqrt(kernel, monkeypatch, opt_cls, decoupled, wd, betas, n):
    monkeypatch.setattr(adam, "kernel_choice", "cpp")
    p0, grads, ref_p, state = reference(n, opt_cls, wd, betas, seed=n)
    rounded_p, rounded_state = correctly_rounded_reference(p0, grads, decoupled, wd, betas)
    for dtype in (None, torch.bfloat16, torch.float16):
        p, m, v, out16 = run_ours(p0, grads, decoupled, wd, betas, dtype, False)
        assert_bit_identical(p, m, v, out16, rounded_p, rounded_state)
    # Against torch itself only sqrt's last bit differs: params are close, and so are the
    # moments where Adam's L2 term feeds p back into the gradient (else they are equal).
    torch.testing.assert_close(p, ref_p, rtol=2**-22, atol=1e-9)
    if decoupled or wd == 0:
        assert torch.equal(m, state["exp_avg"]) and torch.equal(v, state["exp_avg_sq"])
    else:
        torch.testing.assert_close(m, state["exp_avg"], rtol=2**-22, atol=wd * 1e-6)  # wd * ulp(p)-sized


def test_kernel_downcast_special_values(kernel, monkeypatch):
    """fp16 overflow to inf, subnormals, signed zero: out16 is exactly p32.to(dtype)."""
    monkeypatch.setattr(adam, "kernel_choice", "cpp")
    values = torch.tensor([0.0, -0.0, 1e-7, -1e-7, 6e-8, 65504.0, 65520.0, 1e5, -1e5, 3e38, 1.0 + 2**-9, 1.0 + 2**-8])
    p = values.repeat(9)  # 108 elements: full vectors and a tail
    g, m, v = torch.zeros_like(p), torch.zeros_like(p), torch.zeros_like(p)
    for dtype in (torch.bfloat16, torch.float16):
        out = torch.empty(p.numel(), dtype=dtype)
        adam.adamw_step_(p, g, m, v, 1, 0.0, (0.9, 0.999), 1e-8, 0.0, out)
        assert torch.equal(p, values.repeat(9)), "lr 0, grad 0: params unchanged"
        assert torch.equal(out.view(torch.int16), p.to(dtype).view(torch.int16)), dtype


def test_kernel_thread_count_independent(kernel):
    n = 200001
    results = []
    for threads in (1, 2):
        old = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            p0, grads, _, _ = reference(n, torch.optim.AdamW, 0.01, (0.9, 0.999))
            results.append(run_ours(p0, grads, True, 0.01, (0.9, 0.999), torch.bfloat16, False))
        finally:
            torch.set_num_threads(old)
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_kernel_traces_with_fake_tensors(kernel):
    args = [torch.randn(64), torch.randn(64), torch.zeros(64), torch.zeros(64), torch.empty(64, dtype=torch.bfloat16)]
    torch.library.opcheck(torch.ops.tensorstow.adam_step_.default,
                          (*args, 1, 1e-3, 0.9, 0.999, 1e-8, 0.01, True, True))
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(t) for t in args]
        torch.ops.tensorstow.adam_step_(*fake, 3, 1e-3, 0.9, 0.999, 1e-8, 0.01, True, True)


def test_kernel_rejects_bad_tensors(kernel):
    p, g, m, v = (torch.zeros(16) for _ in range(4))
    op = torch.ops.tensorstow.adam_step_
    with pytest.raises(RuntimeError, match="grad must be float32, bfloat16 or float16"):
        op(p, g.double(), m, v, None, 1, 1e-3, 0.9, 0.999, 1e-8, 0.0, True, True)
    with pytest.raises(RuntimeError, match="grad must be contiguous"):
        op(p, torch.zeros(32, dtype=torch.bfloat16)[::2], m, v, None, 1, 1e-3, 0.9, 0.999, 1e-8, 0.0, True, True)
    with pytest.raises(RuntimeError, match="grad_scale must be finite"):
        op(p, g, m, v, None, 1, 1e-3, 0.9, 0.999, 1e-8, 0.0, True, True, float("inf"))
    with pytest.raises(RuntimeError, match="exp_avg must be contiguous"):
        op(p, g, torch.zeros(32)[::2], v, None, 1, 1e-3, 0.9, 0.999, 1e-8, 0.0, True, True)
    with pytest.raises(RuntimeError, match="param16 must be bfloat16 or float16"):
        op(p, g, m, v, torch.zeros(16), 1, 1e-3, 0.9, 0.999, 1e-8, 0.0, True, True)
    with pytest.raises(RuntimeError, match="step .* must be >= 1"):
        op(p, g, m, v, None, 0, 1e-3, 0.9, 0.999, 1e-8, 0.0, True, True)
    with pytest.raises(RuntimeError, match="param and exp_avg share memory"):
        op(p, g, p, v, None, 1, 1e-3, 0.9, 0.999, 1e-8, 0.0, True, True)


@pytest.mark.parametrize("bad,match", [
    (dict(grad=torch.zeros(8, dtype=torch.float64)), "grad must be a float32/bfloat16/float16 CPU tensor"),
    (dict(m=torch.zeros(9)), "m has 9 elements but p32 has 8"),
    (dict(out16=torch.zeros(8)), "out16 must be a bfloat16 or float16"),
    (dict(out16=torch.zeros(9, dtype=torch.bfloat16)), "out16 must be contiguous with 8 elements"),
    (dict(step=0), "step is the step number after this update"),
    (dict(betas=(1.0, 0.999)), "0 <= betas < 1"),
    ("m=v", "m and v share memory"),
])
def test_step_rejects_bad_arguments(monkeypatch, bad, match):
    monkeypatch.setattr(adam, "kernel_choice", "torch")
    kwargs = dict(p32=torch.zeros(8), grad=torch.zeros(8), m=torch.zeros(8), v=torch.zeros(8), step=1, lr=1e-3,
                  betas=(0.9, 0.999), eps=1e-8, wd=0.0, out16=None)
    if bad == "m=v":
        kwargs["m"] = kwargs["v"]
    else:
        kwargs.update(bad)
    with pytest.raises(ValueError, match=match):
        adam.adamw_step_(**kwargs)


def test_state_slices_of_one_buffer(monkeypatch):
    """m and v as neighbouring slices of one flat buffer (a common layout) are accepted."""
    buf = torch.zeros(2 * 1000)
    p0, grads, ref_p, state = reference(1000, torch.optim.AdamW, 0.01, (0.9, 0.999))
    for engine in ("torch", "auto"):
        monkeypatch.setattr(adam, "kernel_choice", engine)
        buf.zero_()
        p, m, v = p0.clone(), buf[:1000], buf[1000:]
        for step, g in enumerate(grads, start=1):
            adam.adamw_step_(p, g, m, v, step, 1e-3, (0.9, 0.999), 1e-8, 0.01, exact=True)
        assert_bit_identical(p, m, v, None, ref_p, state)


def test_bad_engine_choice(monkeypatch):
    monkeypatch.setattr(adam, "kernel_choice", "fortran")
    with pytest.raises(TensorstowError, match="CPU Adam 'fortran': use auto, cpp, torch"):
        adam.kernel_info()


def test_a_subgroup_step_equals_tensor_by_tensor_and_takes_strided_tensors():
    """`adamw_steps_` (the executor's loop) gives exactly `adamw_step_` per tensor; a tensor
    stored with a kept (non-contiguous) stride takes torch's fused kernel instead of failing."""
    torch.manual_seed(0)
    shapes = [(3, 5), (17,), (64, 33)]
    make = lambda: [torch.randn(s) for s in shapes]  # noqa: E731
    p, g = make(), [t * 1e-2 for t in make()]
    m, v = [torch.zeros(s) for s in shapes], [torch.zeros(s) for s in shapes]
    out = [torch.empty(s, dtype=torch.bfloat16) for s in shapes]
    p2, m2, v2 = [t.clone() for t in p], [t.clone() for t in m], [t.clone() for t in v]
    out2 = [t.clone() for t in out]
    for step in (1, 2, 3):
        adam.adamw_steps_(p, g, m, v, step, 1e-3, (0.9, 0.999), 1e-8, 0.01, out)
        for k in range(len(shapes)):
            adam.adamw_step_(p2[k], g[k], m2[k], v2[k], step, 1e-3, (0.9, 0.999), 1e-8, 0.01, out2[k])
    assert all(torch.equal(a, b) for a, b in zip(p + m + v + out, p2 + m2 + v2 + out2))

    base = torch.randn(33, 64)
    strided = base.t()  # a (64, 33) view with a kept stride
    pf, gf = strided.clone(), torch.randn(64, 33) * 1e-2
    mf, vf = torch.zeros(64, 33), torch.zeros(64, 33)
    o16 = torch.empty(64, 33, dtype=torch.bfloat16)
    adam.adamw_steps_([strided], [gf], [torch.zeros(64, 33)], [torch.zeros(64, 33)], 1, 1e-3, (0.9, 0.999),
                      1e-8, 0.01, [o16])
    torch._fused_adamw_([pf], [gf], [mf], [vf], [], [torch.tensor(1.0)], lr=1e-3, beta1=0.9, beta2=0.999,
                        weight_decay=0.01, eps=1e-8, amsgrad=False, maximize=False)
    assert torch.equal(strided, pf) and torch.equal(o16, pf.to(torch.bfloat16))


@pytest.mark.parametrize("engine", ["cpp", "torch"])
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("scale", [1.0, 0.3183])
def test_a_16_bit_or_scaled_gradient_equals_the_step_on_its_widened_product(request, monkeypatch, engine,
                                                                             grad_dtype, scale):
    """A mixed-precision step's 16-bit gradient is read in its width, times clip_grad_norm_'s
    coefficient: the update equals torch.optim.AdamW on `grad.float()` multiplied in place by that
    coefficient (eager's clip), bit for bit with exact=True, on every engine and on sizes with
    tails and several threads; the gradient itself is left as it was."""
    if engine == "cpp":
        request.getfixturevalue("kernel")
    monkeypatch.setattr(adam, "kernel_choice", engine)
    coef = torch.tensor(scale, dtype=torch.float32)
    for n in (7, 1000, 65537, 300007):
        gen = torch.Generator().manual_seed(n)
        p0 = torch.randn(n, generator=gen)
        grads = [(torch.randn(n, generator=gen) * 0.1).to(grad_dtype) for _ in range(3)]
        ref = p0.clone().requires_grad_(True)
        opt = torch.optim.AdamW([ref], lr=1e-3, weight_decay=0.01, foreach=False)
        p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
        out16 = torch.empty(n, dtype=torch.bfloat16)
        for step, g in enumerate(grads, start=1):
            wide = g.to(torch.float32, copy=True)
            torch._foreach_mul_([wide], coef)
            ref.grad = wide
            opt.step()
            before = g.clone()
            adam.adamw_step_(p, g, m, v, step, 1e-3, (0.9, 0.999), 1e-8, 0.01, out16, exact=True,
                             grad_scale=float(coef))
            assert torch.equal(g, before)
        assert torch.equal(p, ref.detach()) and torch.equal(out16, p.to(torch.bfloat16))
        assert torch.equal(m, opt.state[ref]["exp_avg"]) and torch.equal(v, opt.state[ref]["exp_avg_sq"])
        # the executor's loop (fast sqrt) gives the same as its per-tensor step
        q, mq, vq = p0.clone(), torch.zeros(n), torch.zeros(n)
        q2, mq2, vq2 = p0.clone(), torch.zeros(n), torch.zeros(n)
        for step, g in enumerate(grads, start=1):
            adam.adamw_steps_([q], [g], [mq], [vq], step, 1e-3, (0.9, 0.999), 1e-8, 0.01, grad_scale=float(coef))
            wide = g.to(torch.float32, copy=True)
            torch._foreach_mul_([wide], coef)
            adam.adamw_step_(q2, wide, mq2, vq2, step, 1e-3, (0.9, 0.999), 1e-8, 0.01)
        assert torch.equal(q, q2) and torch.equal(mq, mq2) and torch.equal(vq, vq2)
