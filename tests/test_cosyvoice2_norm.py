"""The fused LayerNorm (+ Mish + row mask) kernel of the flow estimator (worker/cosyvoice2/norm_kernel.py).

The kernel is checked against F.layer_norm / F.mish on the same (rounded) inputs computed in fp32,
on CUDA and, without a GPU, under Triton's interpreter (TRITON_INTERPRET=1, CPU tensors). Tolerances
(|got - want| <= atol + rtol |want|):
  - fp32: 1e-5 both (measured ~2e-6 interpreted: fast exp/rsqrt, another summation order);
  - fp16: 1e-3 both, about one ulp (the kernel rounds once; measured half an ulp);
  - bf16: 1e-2 abs, 8e-3 rel, one ulp (the interpreter truncates to bf16, CUDA rounds to nearest).
The whole estimator: fused vs eager on the fixture's recorded inputs within 1e-5 in fp32 and 2e-2 in
fp16 (measured interpreted: 1.9e-6 and 4.4e-3, outputs up to 2.8; fp16 eager is itself 4.3e-3 from
the fp32 reference). On CPU without the interpreter FUSED_NORM falls back to eager, bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.triton_interpreter import INTERPRETED, interpreted, run_interpreted
from voxbatch.worker.cosyvoice2 import flow_estimator, norm_kernel
from voxbatch.worker.cosyvoice2.flow import CausalFlow
from voxbatch.worker.cosyvoice2.norm_kernel import fused_layer_norm

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-3, 1e-3), torch.bfloat16: (1e-2, 8e-3)}  # atol, rtol
EST_TOL = {torch.float32: 1e-5, torch.float16: 2e-2}
EPS = 1e-5
SHAPES = [(3, 37, 256), (2, 600, 256), (5, 11, 80), (4, 192)]  # rows not a multiple of BLOCK_M; C not a power of two


def test_under_triton_interpreter() -> None:
    """The `interpreted` tests below, in a child pytest with TRITON_INTERPRET=1 (no GPU needed)."""
    run_interpreted(__file__)


def _inputs(shape: tuple[int, ...], dtype: torch.dtype, device: str):
    """x (..., C) with a constant row (variance 0: the output is the bias) and a row of variance 9e-6
    (near eps), an affine near the identity, and a 0/1 mask (..., 1)."""
    g = torch.Generator().manual_seed(sum(shape))
    C = shape[-1]
    x = torch.randn(shape, generator=g) * 3 + 1
    x.view(-1, C)[0] = 2.5
    x.view(-1, C)[1] *= 1e-3
    w = 1 + 0.5 * torch.randn(C, generator=g)
    b = 0.2 * torch.randn(C, generator=g)
    mask = (torch.rand(*shape[:-1], 1, generator=g) > 0.3).float()
    return (t.to(device, dtype) for t in (x, w, b, mask))


def _check(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> None:
    x, w, b, mask = _inputs(shape, dtype, device)
    # The reference in fp64 on the rounded inputs: PyTorch's fp32 LayerNorm on CUDA (Welford) leaves the
    # constant row's x - mean at an ulp of x, which 1/sqrt(eps) magnifies to ~6e-5 (seen on the H200).
    want = F.layer_norm(x.double(), (shape[-1],), w.double(), b.double(), EPS)
    atol, rtol = TOL[dtype]
    for m, ref in ((None, want), (mask, F.mish(want) * mask.double())):
        got = fused_layer_norm(x, w, b, EPS, m)
        assert got is not None and got.dtype == dtype and got.shape == x.shape
        torch.testing.assert_close(got.double(), ref, atol=atol, rtol=rtol)
    # With a row add (a resnet's time embedding, one vector per batch row b of x (B, T, C)), before the mask.
    if len(shape) == 3:
        add = (0.5 * torch.randn(shape[0], shape[-1], generator=torch.Generator().manual_seed(5))).to(device, dtype)
        ref = (F.mish(want) + add.double()[:, None, :]) * mask.double()
        got = fused_layer_norm(x, w, b, EPS, mask, None, add)
        assert got is not None and got.dtype == dtype and got.shape == x.shape
        torch.testing.assert_close(got.double(), ref, atol=atol, rtol=rtol)
    # With a shift (the transformer stream's deferred biases): the LayerNorm of x + shift, the sum
    # rounded to x's dtype first as eager's is. Not bf16 under the interpreter: it truncates that sum
    # where CUDA rounds it, an ulp of ~2.5 that the normalisation magnifies past the tolerance.
    if INTERPRETED and dtype == torch.bfloat16:
        return
    shift = (0.3 * torch.randn(shape[-1], generator=torch.Generator().manual_seed(7))).to(device, dtype)
    shifted = (x + shift).double()
    want = F.layer_norm(shifted, (shape[-1],), w.double(), b.double(), EPS)
    for m, ref in ((None, want), (mask, F.mish(want) * mask.double())):
        got = fused_layer_norm(x, w, b, EPS, m, shift)
        assert got is not None and got.dtype == dtype and got.shape == x.shape
        torch.testing.assert_close(got.double(), ref, atol=atol, rtol=rtol)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_interpreted(shape, dtype) -> None:
    _check(shape, dtype, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [*SHAPES, (128, 602, 256), (2, 3, 4096)])
@torch.inference_mode()
def test_kernel_on_gpu(shape, dtype) -> None:
    _check(shape, dtype, "cuda")


def test_kernel_declines() -> None:
    """None (the caller's eager form) where the kernel cannot or should not run."""
    x, w, b, mask = _inputs((2, 5, 64), torch.float32, "cpu")
    if not INTERPRETED:
        assert fused_layer_norm(x, w, b, EPS) is None  # a CPU tensor
    if torch.cuda.is_available():
        x, w, b, mask = (t.cuda() for t in (x, w, b, mask))
        assert fused_layer_norm(x.transpose(0, 1), w, b, EPS) is None  # not contiguous
        assert fused_layer_norm(x, w, b, EPS, mask[:, :2]) is None  # mask of another shape
        assert fused_layer_norm(x, w, b, EPS, None, b[:-1]) is None  # shift of another width
        assert fused_layer_norm(x, w, b, EPS, None, b.half()) is None  # shift in another dtype
        assert fused_layer_norm(x, w, b, EPS, None, None, w[None].expand(2, -1).contiguous()) is None  # a row add needs a mask
        assert fused_layer_norm(x, w, b, EPS, mask, None, w[None]) is None  # one row add for two rows
        wide = torch.zeros(1, 2 * norm_kernel.MAX_C, device="cuda")
        assert fused_layer_norm(wide, torch.ones(wide.shape[1], device="cuda"), torch.zeros(wide.shape[1], device="cuda"), EPS) is None
        with torch.autocast("cuda", dtype=torch.float16):
            assert fused_layer_norm(x, w, b, EPS) is None  # eager LayerNorm returns fp32 under autocast
        with torch.enable_grad():
            assert fused_layer_norm(x, w.requires_grad_(), b, EPS) is None  # no backward


# ---------------------------------------------------------------------------------------------
# The whole estimator


def _estimator_outputs(flow: CausalFlow, ref: dict, device: str) -> dict[bool, torch.Tensor]:
    """The fixture's first recorded estimator call with FUSED_NORM on and off."""
    args = [torch.from_numpy(ref[f"flow_est0_in_{k}"]).to(device) for k in ("x", "mask", "mu", "t", "spks", "cond")]
    out = {}
    for fused in (True, False):
        flow_estimator.FUSED_NORM = fused
        try:
            with torch.inference_mode():
                out[fused] = flow.decoder.estimator(*args, streaming=False).float().cpu()
        finally:
            flow_estimator.FUSED_NORM = True
    return out


def _counting(monkeypatch) -> list[bool]:
    """Records, per LayerNorm of the estimator, whether the kernel ran."""
    ran: list[bool] = []

    def counted(*args, **kwargs):
        out = fused_layer_norm(*args, **kwargs)
        ran.append(out is not None)
        return out

    monkeypatch.setattr(flow_estimator, "fused_layer_norm", counted)
    return ran


def test_estimator_on_cpu_is_eager(tiny_model_dir: Path, ref: dict) -> None:
    """FUSED_NORM on CPU takes the eager path: bit-identical output."""
    flow = CausalFlow.from_model_dir(tiny_model_dir, "cpu", torch.float32)
    out = _estimator_outputs(flow, ref, "cpu")
    assert torch.equal(out[True], out[False])


def _check_estimator(model_dir: Path, ref: dict, device: str, dtype: torch.dtype, monkeypatch) -> None:
    flow = CausalFlow.from_model_dir(model_dir, device, dtype)
    ran = _counting(monkeypatch)
    out = _estimator_outputs(flow, ref, device)
    assert ran and all(ran), "the kernel fell back to eager"
    assert torch.isfinite(out[True]).all()
    diff = float((out[True] - out[False]).abs().max())
    assert diff <= EST_TOL[dtype], diff


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_estimator_interpreted(tiny_model_dir: Path, ref: dict, monkeypatch, dtype) -> None:
    _check_estimator(tiny_model_dir, ref, "cpu", dtype, monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_estimator_on_gpu(tiny_model_dir: Path, ref: dict, monkeypatch, dtype) -> None:
    _check_estimator(tiny_model_dir, ref, "cuda", dtype, monkeypatch)
