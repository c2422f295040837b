"""HiFT channels-last (`hift.CHANNELS_LAST`): activations and conv weights stored (B, T, C).

The Snake and conv-epilogue kernels take either layout with the same arithmetic per element, so on a
channels-last input they give, bit for bit, what they give on the same values stored (B, C, T) (Snake's
on CUDA here; the epilogue's in tests/test_cosyvoice2_conv_epilogue.py, under Triton's interpreter too). HiFT's decode with it runs every masked conv and
Snake on channels-last tensors and stays within the fixture's decode tolerance of the reference (the
convolutions are other kernels, so the waveform moves by their rounding); on a GPU, batched against
single stays within the same bound as the default layout's.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.triton_interpreter import interpreted, run_interpreted
from voxbatch.worker.cosyvoice2 import hift as hift_mod
from voxbatch.worker.cosyvoice2.conv_epilogue import conv_epilogue
from voxbatch.worker.cosyvoice2.hift import HiFTGenerator, to_channels_last
from voxbatch.worker.cosyvoice2.lazy_kernel import channels_last
from voxbatch.worker.cosyvoice2.snake_kernel import fused_snake

pytestmark = pytest.mark.usefixtures("one_torch_thread")

WAV_TOL = 1e-4  # the fixture's decode tolerance (tests/test_cosyvoice2_hift.py)


def test_under_triton_interpreter() -> None:
    """The `interpreted` tests below, in a child pytest with TRITON_INTERPRET=1 (no GPU needed)."""
    run_interpreted(__file__)


def test_layouts_are_told_apart() -> None:
    x = torch.randn(2, 3, 5)
    assert channels_last(x) is False and channels_last(to_channels_last(x)) is True
    assert torch.equal(to_channels_last(x), x) and to_channels_last(x).stride() == (15, 1, 3)
    assert channels_last(x[:, :, ::2]) is None and channels_last(torch.randn(2, 3)) is None
    assert channels_last(torch.randn(2, 1, 5).transpose(1, 2).contiguous().transpose(1, 2)) is False  # both: contiguous


@pytest.mark.parametrize("conv", [
    torch.nn.Conv1d(6, 5, 7, padding=3), torch.nn.Conv1d(6, 5, 3, dilation=5, padding=5), torch.nn.Conv1d(6, 5, 1),
    torch.nn.Conv1d(6, 5, 30, 15, padding=7), torch.nn.ConvTranspose1d(6, 5, 16, 8, padding=4),
    torch.nn.ConvTranspose1d(6, 5, 11, 5, padding=3, output_padding=1)], ids=str)
def test_conv_any_layout_is_the_conv(conv, monkeypatch) -> None:
    """A channels-last x runs as the same conv (stride, padding, dilation, output padding as the module
    has them) through the 2-D form, within rounding of the module's own call, and comes out channels-last;
    the default layout is the module's call bit for bit."""
    monkeypatch.setattr(hift_mod, "_CL_DEVICES", ("cpu",))
    x = torch.randn(3, 6, 41, generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        want = conv(x)
        assert torch.equal(hift_mod.conv1d_any_layout(conv, x, conv.bias), want)
        monkeypatch.setattr(hift_mod, "CHANNELS_LAST", True)
        got = hift_mod.conv1d_any_layout(conv, to_channels_last(x), conv.bias)
    assert got.shape == want.shape and channels_last(got) is True
    assert float((got - want).abs().max()) <= 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(2, 3, 5), (3, 4, 1061), (64, 128, 40_000)])
def test_snake_takes_channels_last_on_gpu(shape) -> None:
    """Snake's kernel on a channels-last x gives, bit for bit, what it gives on x stored (B, C, T), in
    x's layout, within one rounding of the eager form. (Not under Triton's interpreter, which does not
    resolve the kernel's libdevice sine; the conv epilogue's layouts are checked in its own tests.)"""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    B, C, T = shape
    g = torch.Generator().manual_seed(T)
    x = (torch.randn(B, C, T, generator=g) * 3).cuda()
    alpha = torch.rand(C, generator=g).cuda() + 0.5
    alpha_inv = torch.stack([alpha, 1.0 / (alpha + 1e-9)])
    plain, last = fused_snake(x, alpha_inv), fused_snake(to_channels_last(x), alpha_inv)
    assert plain is not None and last is not None and channels_last(last) is True
    assert torch.equal(last, plain)
    eager = x + alpha_inv[1][None, :, None] * torch.sin(x * alpha_inv[0][None, :, None]).pow(2)
    assert float((last - eager).abs().max()) <= 1e-5 * float(eager.abs().max())


def _decode(model: HiFTGenerator, device: str, monkeypatch, ref: dict, frames: int | None = None) -> tuple[torch.Tensor, list]:
    """The fixture's mel decoded with CHANNELS_LAST on (opened on `device`), and the layout of each
    masked conv's input and output and each Snake's input."""
    layouts: list = []
    conv, snake = hift_mod.masked_conv, hift_mod.Snake.forward

    def conv_seen(c, x, mask, skip=None, then=None):
        y = conv(c, x, mask, skip, then)
        layouts.extend((channels_last(x), channels_last(y)))
        return y

    def snake_seen(self, x):
        layouts.append(channels_last(x))
        return snake(self, x)

    monkeypatch.setattr(hift_mod, "masked_conv", conv_seen)
    monkeypatch.setattr(hift_mod.Snake, "forward", snake_seen)
    monkeypatch.setattr(hift_mod, "CHANNELS_LAST", True)
    monkeypatch.setattr(hift_mod, "_CL_DEVICES", (device,))
    mel, source = (torch.from_numpy(np.ascontiguousarray(ref[k])).to(device) for k in ("hift_mel", "hift_source"))
    if frames is not None:  # a short cut, for the interpreter
        mel, source = mel[:, :, :frames], source[:, :, : frames * model.d.samples_per_frame]
    with torch.inference_mode():
        return model.decode(mel, source).cpu(), layouts


def test_decode_channels_last_on_cpu(tiny_model_dir: Path, ref: dict, monkeypatch) -> None:
    """Every masked conv and Snake sees channels-last tensors, and the waveform stays within the
    fixture's decode tolerance of the reference."""
    model = HiFTGenerator.from_model_dir(tiny_model_dir, "cpu", torch.float32)
    wav, layouts = _decode(model, "cpu", monkeypatch, ref)
    assert layouts and all(layout is True for layout in layouts), layouts
    assert float((wav - torch.from_numpy(ref["hift_wav"])).abs().max()) <= WAV_TOL


@interpreted
def test_decode_channels_last_interpreted(tiny_model_dir: Path, ref: dict, monkeypatch) -> None:
    """The same with the Triton kernels (interpreted) doing the epilogues in channels-last: every
    epilogue ran the kernel, and the waveform is the eager channels-last one's within 1e-5."""
    model = HiFTGenerator.from_model_dir(tiny_model_dir, "cpu", torch.float32)
    ran = []

    def counted(*args):
        out = conv_epilogue(*args)
        ran.append(out is not None and channels_last(out) is True)
        return out

    monkeypatch.setattr(hift_mod, "conv_epilogue", counted)
    fused, layouts = _decode(model, "cpu", monkeypatch, ref, frames=24)
    assert ran and all(ran) and all(layout is True for layout in layouts)
    monkeypatch.setattr(hift_mod, "FUSED_CONV_EPILOGUE", False)
    eager, _ = _decode(model, "cpu", monkeypatch, ref, frames=24)
    assert float((fused - eager).abs().max()) <= 1e-5


@pytest.mark.gpu
@torch.inference_mode()
def test_decode_channels_last_on_gpu(tiny_model_dir: Path, ref: dict, monkeypatch) -> None:
    """On CUDA with TF32 off (as the fixture's GPU test): every masked conv and Snake on channels-last
    tensors, the waveform within the decode tolerance of the reference, and a batch's rows within 1e-4
    of the same rows alone (the default layout's bound)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        model = HiFTGenerator.from_model_dir(tiny_model_dir, "cuda", torch.float32)
        wav, layouts = _decode(model, "cuda", monkeypatch, ref)
        assert layouts and all(layout is True for layout in layouts), layouts
        assert float((wav - torch.from_numpy(ref["hift_wav"])).abs().max()) <= WAV_TOL
        full = torch.from_numpy(np.ascontiguousarray(ref["e2e_flow_mel"])).cuda()
        lengths = [full.shape[2], full.shape[2] * 2 // 3, full.shape[2] // 3]
        padded = torch.full((3, full.shape[1], lengths[0]), 3.0, device="cuda")
        for i, n in enumerate(lengths):
            padded[i, :, :n] = full[0, :, :n]
        gens = lambda seeds: [torch.Generator(device="cuda").manual_seed(s) for s in seeds]  # noqa: E731
        batched, _ = model.inference(padded, lengths, gens((1, 2, 3)))
        for i, n in enumerate(lengths):
            one, _ = model.inference(full[:, :, :n], [n], gens((i + 1,)))
            assert float((batched[i : i + 1, : one.shape[1]] - one).abs().max()) <= 1e-4


def _layout_transposes(model: HiFTGenerator, mel: torch.Tensor, source: torch.Tensor) -> int:
    """cuDNN's NCHW<->NHWC transpose kernels in one decode (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with torch.inference_mode(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        model.decode(mel, source)
        torch.cuda.synchronize()
    return sum(e.count for e in prof.key_averages() if "ToNhwc" in e.key or "ToNchw" in e.key)


@pytest.mark.gpu
def test_channels_last_decode_drops_cudnns_layout_transposes(monkeypatch) -> None:
    """What the switch is for: with CHANNELS_LAST, cuDNN runs HiFT's convolutions without most of its
    NCHW<->NHWC transposes (fewer than a third of the default layout's, counted in the profiler), at the
    default (CosyVoice2-0.5B) dims with random weights, where the default layout has them
    (bench/results/gpu_h100_worker26_profile.txt)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    torch.manual_seed(0)
    model = HiFTGenerator(hift_mod.HiftDims()).cuda().eval()
    mel = torch.randn(4, model.d.in_channels, 200, device="cuda")
    source = torch.randn(4, 1, 200 * model.d.samples_per_frame, device="cuda") * 0.1
    counts = {}
    for on in (False, True):
        monkeypatch.setattr(hift_mod, "CHANNELS_LAST", on)
        _layout_transposes(model, mel, source)  # warm: plans and kernels built
        counts[on] = _layout_transposes(model, mel, source)
    assert counts[False] > 0 and counts[True] * 3 < counts[False], counts
