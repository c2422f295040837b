"""HiFT's fused conv epilogue, (conv(x) + bias) * mask [+ skip] (worker/cosyvoice2/conv_epilogue.py).

The kernel claims the eager form's roundings in its order, so it is checked bit for bit (torch.equal)
against (y + bias) * mask [+ skip] on the same conv output, stored (B, C, T) and channels-last: under Triton's interpreter (CPU tensors,
no GPU) and on CUDA. HiFT with the epilogue on and off: bit-identical on CUDA (torch's cuDNN conv adds
its bias after the conv, as the kernel does); under the interpreter the eager CPU conv (oneDNN) folds
the bias into the conv and rounds otherwise, so there the waveforms agree within 1e-5. On CPU without
the interpreter the flag changes nothing.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.triton_interpreter import interpreted, run_interpreted
from voxbatch.worker.cosyvoice2 import hift as hift_mod
from voxbatch.worker.cosyvoice2.conv_epilogue import BLOCK_T, conv_epilogue
from voxbatch.worker.cosyvoice2.hift import HiFTGenerator, to_channels_last
from voxbatch.worker.cosyvoice2.lazy_kernel import channels_last

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SHAPES = [(2, 3, 5), (3, 4, BLOCK_T + 37), (1, 1, 2 * BLOCK_T)]  # a row of one block, across blocks, exactly two


def test_under_triton_interpreter() -> None:
    """The `interpreted` tests below, in a child pytest with TRITON_INTERPRET=1 (no GPU needed)."""
    run_interpreted(__file__)


def _inputs(shape: tuple[int, int, int], device: str) -> tuple[torch.Tensor, ...]:
    """Conv output y, bias, a 0/1 prefix mask per row (one row full, one empty where B > 2), skip."""
    B, C, T = shape
    g = torch.Generator().manual_seed(B * C + T)
    y, skip = torch.randn(B, C, T, generator=g) * 3, torch.randn(B, C, T, generator=g)
    bias = torch.randn(C, generator=g)
    lens = [T, *(int(n) for n in torch.randint(0, T + 1, (B - 1,), generator=g))]
    mask = (torch.arange(T)[None, :] < torch.tensor(lens)[:, None]).float()[:, None]
    return tuple(t.to(device) for t in (y, bias, mask, skip))


def _check_kernel(shape: tuple[int, int, int], device: str, stored_channels_last: bool = False) -> None:
    """The kernel against the eager form, bit for bit, on y (and the skip) stored (B, C, T) or
    channels-last (hift.CHANNELS_LAST: the output keeps that layout; a skip in the other layout than
    y's is declined, for the caller's eager form)."""
    y, bias, mask, skip = _inputs(shape, device)
    want = (y + bias[None, :, None]) * mask
    layout = (lambda t: to_channels_last(t.clone())) if stored_channels_last else torch.clone  # y is written over
    for s, ref in ((None, want), (skip, skip + want)):
        got = conv_epilogue(layout(y), bias, mask, None if s is None else layout(s))
        assert got is not None and got.shape == y.shape and channels_last(got) is channels_last(layout(y))
        assert torch.equal(got, ref)
    if channels_last(layout(y)):  # (C or T of 1: the two layouts are one)
        assert conv_epilogue(layout(y), bias, mask, skip) is None


def _decode(model: HiFTGenerator, fused: bool, device: str, monkeypatch, ref: dict) -> torch.Tensor:
    """HiFT's decode of a short cut of the fixture's mel with the epilogue on or off; on, every masked
    conv must have run the kernel (a silent eager fallback would compare eager with itself)."""
    ran = []

    def counted(*args):
        out = conv_epilogue(*args)
        ran.append(out is not None)
        return out

    monkeypatch.setattr(hift_mod, "conv_epilogue", counted)
    mel = torch.from_numpy(np.ascontiguousarray(ref["hift_mel"]))[:, :, :24].to(device)  # (1, 80, 24): short, for the interpreter
    source = torch.from_numpy(np.ascontiguousarray(ref["hift_source"]))[:, :, : 24 * model.d.samples_per_frame].to(device)
    monkeypatch.setattr(hift_mod, "FUSED_CONV_EPILOGUE", fused)
    with torch.inference_mode():
        wav = model.decode(mel, source).cpu()
    assert not fused or (ran and all(ran)), ran
    return wav


@interpreted
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("stored_channels_last", [False, True])
def test_kernel_interpreted(shape, stored_channels_last) -> None:
    _check_kernel(shape, "cpu", stored_channels_last)
    _check_snake_kernel(shape, "cpu", stored_channels_last)


@interpreted
def test_decode_interpreted(tiny_model_dir: Path, ref: dict, monkeypatch) -> None:
    model = HiFTGenerator.from_model_dir(tiny_model_dir, "cpu", torch.float32)
    eager, fused = (_decode(model, f, "cpu", monkeypatch, ref) for f in (False, True))
    assert float((fused - eager).abs().max()) <= 1e-5


def test_declines_what_it_does_not_take() -> None:
    """CPU outside the interpreter, fp16, a mask of the wrong shape, no bias: None (the caller is eager)."""
    y, bias, mask, _ = _inputs((2, 3, 5), "cpu")
    assert conv_epilogue(y, bias, mask) is None  # CPU, not interpreting (this process)
    if torch.cuda.is_available():
        y, bias, mask = y.cuda(), bias.cuda(), mask.cuda()
        assert conv_epilogue(y.half(), bias.half(), mask.half()) is None
        assert conv_epilogue(y, bias, mask[:, :, :4].contiguous()) is None
        assert conv_epilogue(y, None, mask) is None


def test_flag_changes_nothing_on_cpu(tiny_model_dir: Path, ref: dict, monkeypatch) -> None:
    """Without the interpreter a CPU never reaches the kernel: eager either way, bit for bit."""
    model = HiFTGenerator.from_model_dir(tiny_model_dir, "cpu", torch.float32)
    mel, source = (torch.from_numpy(np.ascontiguousarray(ref[k])) for k in ("hift_mel", "hift_source"))
    wavs = []
    for flag in (True, False):
        monkeypatch.setattr(hift_mod, "FUSED_CONV_EPILOGUE", flag)
        with torch.inference_mode():
            wavs.append(model.decode(mel, source))
    assert torch.equal(*wavs)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [*SHAPES, (64, 128, 40_000)])
@pytest.mark.parametrize("stored_channels_last", [False, True])
def test_kernel_on_gpu(shape, stored_channels_last) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    _check_kernel(shape, "cuda", stored_channels_last)
    _check_snake_kernel(shape, "cuda", stored_channels_last)


@pytest.mark.gpu
def test_decode_bit_identical_on_gpu(tiny_model_dir: Path, ref: dict, monkeypatch) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    model = HiFTGenerator.from_model_dir(tiny_model_dir, "cuda", torch.float32)
    assert torch.equal(_decode(model, True, "cuda", monkeypatch, ref), _decode(model, False, "cuda", monkeypatch, ref))
    # and with each residual block's second Snake in its first conv's epilogue (SNAKE_IN_EPILOGUE)
    assert torch.equal(_decode_snake(model, False, "cuda", monkeypatch, ref), _decode_snake(model, True, "cuda", monkeypatch, ref))


# -- a residual block's second Snake in its first conv's epilogue (hift.SNAKE_IN_EPILOGUE) ----------------


def _check_snake_kernel(shape: tuple[int, int, int], device: str, stored_channels_last: bool) -> None:
    """The epilogue with a Snake against the epilogue kernel then the Snake kernel, bit for bit, with and
    without a skip, in either layout; Snake's alpha spread over [0.2, 3] so the sine sees large arguments."""
    from voxbatch.worker.cosyvoice2.snake_kernel import fused_snake

    y, bias, mask, skip = _inputs(shape, device)
    alpha = torch.linspace(0.2, 3.0, shape[1], device=device)
    args = torch.stack([alpha, 1.0 / (alpha + 1e-9)])
    layout = (lambda t: to_channels_last(t.clone())) if stored_channels_last else torch.clone
    for s in (None, skip):
        two_kernels = fused_snake(conv_epilogue(layout(y), bias, mask, None if s is None else layout(s)), args)
        one = conv_epilogue(layout(y), bias, mask, None if s is None else layout(s), args)
        assert one is not None and two_kernels is not None and channels_last(one) is channels_last(layout(y))
        assert torch.equal(one, two_kernels)
    assert conv_epilogue(layout(y), bias, mask, None, args[:, :1]) is None or shape[1] == 1  # args of another width


def _decode_snake(model: HiFTGenerator, in_epilogue: bool, device: str, monkeypatch, ref: dict) -> torch.Tensor:
    """HiFT's decode with the epilogue kernel and the Snake kernel forced (the interpreter's CPU tensors
    included), SNAKE_IN_EPILOGUE on or off; on, every residual block's first conv took its Snake in the
    kernel."""
    from voxbatch.worker.cosyvoice2.snake_kernel import fused_snake

    with_snake = []

    def counted(*args):
        out = conv_epilogue(*args)
        with_snake.append(out is not None and len(args) == 5 and args[4] is not None)
        return out

    monkeypatch.setattr(hift_mod, "conv_epilogue", counted)
    monkeypatch.setattr(hift_mod.Snake, "forward", lambda self, x: fused_snake(x, self.kernel_args()))
    monkeypatch.setattr(hift_mod, "FUSED_CONV_EPILOGUE", True)
    monkeypatch.setattr(hift_mod, "SNAKE_IN_EPILOGUE", in_epilogue)
    mel = torch.from_numpy(np.ascontiguousarray(ref["hift_mel"]))[:, :, :24].to(device)
    source = torch.from_numpy(np.ascontiguousarray(ref["hift_source"]))[:, :, : 24 * model.d.samples_per_frame].to(device)
    with torch.inference_mode():
        wav = model.decode(mel, source).cpu()
    blocks = [m for m in model.modules() if isinstance(m, hift_mod.ResBlock)]
    assert sum(with_snake) == (sum(len(b.convs1) for b in blocks) if in_epilogue else 0)
    return wav


@interpreted
def test_snake_in_epilogue_decode_interpreted(tiny_model_dir: Path, ref: dict, monkeypatch) -> None:
    """The decode with each residual block's second Snake in its first conv's epilogue equals the one
    with the two kernels apart, bit for bit."""
    model = HiFTGenerator.from_model_dir(tiny_model_dir, "cpu", torch.float32)
    apart, together = (_decode_snake(model, f, "cpu", monkeypatch, ref) for f in (False, True))
    assert torch.equal(apart, together)


def test_a_kernel_that_fails_is_logged_once_then_skipped(caplog) -> None:
    """LazyKernel (the LayerNorm, Snake and conv-epilogue kernels' wrapper): a build that fails is
    logged once with what falls back, returns None, and is never tried again."""
    from voxbatch.worker.cosyvoice2.lazy_kernel import LazyKernel

    builds = []

    def build():
        builds.append(1)
        raise ImportError("no triton here")

    k = LazyKernel(build, "test kernel", "eager it is")
    with caplog.at_level("WARNING"):
        assert k.run(lambda triton, kernel: 1) is None
        assert k.run(lambda triton, kernel: 1) is None
    assert k.failed and len(builds) == 1
    warnings = [r.getMessage() for r in caplog.records if "test kernel" in r.getMessage()]
    assert warnings == ["test kernel unavailable (ImportError: no triton here); eager it is"]
    ok = LazyKernel(lambda: ("triton", "kernel"), "fine kernel", "-")
    assert ok.run(lambda triton, kernel: (triton, kernel)) == ("triton", "kernel") and not ok.failed
