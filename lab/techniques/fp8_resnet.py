"""FP8 e4m3 resnet convs on the SD-VAE decoder's fastest exact build, each fed in FP8 by the norm pass before it.

    amax = calibrate(decoder, batches)      # after subpixel, fused_norm and graph_conv (notebook 02's best build)
    rows = fp8_resnets(decoder, amax)       # in place; one row per resnet block

In a `GraphResnet` (lab.runtime.conv_graphs) conv1 and conv2 each read the output of a GroupNorm + SiLU pass
(lab.techniques.group_norm). Here that pass writes its output as float8_e4m3fn with the conv's static input scale
(the calibrated |x| max / 448) and the conv is cuDNN's FP8 conv (lab.runtime.cudnn_graph) with the descale, its bias
and, in conv2, the block's skip add in the fp32 epilogue. The cast costs no pass of its own, the norm writes half
the bytes and the conv reads half; the weights are e4m3 with one scale per output channel. The shortcut 1×1 convs,
the upsamplers' convs, conv_in / conv_out and the attention stay fp16: their inputs come from no norm pass.

An approximation (e4m3 keeps 3 mantissa bits): `calibrate` refuses a conv whose input never reached a finite, non-zero
range, and a block stays fp16 where its FP8 convs are not measurably faster (`keep_faster`: cuDNN's FP8 kernels
lose to its fp16 ones on small images, 32² on an H100). Off CUDA the same arithmetic runs on torch's ops (the
cast, the dequantized conv), so the CPU tests check the function, not the speed.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn

from lab.errors import InputError
from lab.runtime import cudnn_graph
from lab.runtime.conv_graphs import GraphConv2d, GraphResnet
from lab.techniques import fp8
from lab.techniques.fp8 import E4M3, E4M3_MAX
from lab.techniques.group_norm import FusedGroupNorm

MIN_GAIN = 1.05   # FP8 within 5 % of the fp16 block's conv time does not pay for its rounding error


class FP8GraphConv(nn.Module):
    """A GraphConv2d's conv in FP8: input already e4m3 with scale `x_scale`, weight e4m3 per output channel;
    descale, bias and an optional residual add in the epilogue, fp16 out (channels-last)."""

    def __init__(self, conv: GraphConv2d, x_scale: float):
        super().__init__()
        if not isinstance(conv, GraphConv2d):
            raise InputError(f"FP8GraphConv takes a GraphConv2d, got {type(conv).__name__}")
        if not (x_scale > 0 and math.isfinite(x_scale)):
            raise InputError(f"FP8GraphConv: the input scale must be finite and > 0, got {x_scale!r}")
        object.__setattr__(self, "fp16", conv)   # unregistered: what plain_resnets puts back
        w_scale = fp8.weight_scale(conv.weight, "per_channel")
        wq, _ = fp8.quantize(conv.weight, w_scale)
        self.register_buffer("weight_fp8", wq.contiguous(memory_format=torch.channels_last))
        self.register_buffer("descale", (w_scale * x_scale).float().contiguous())
        self.x_scale = float(x_scale)
        self.bias = conv.bias
        self.padding, self.stride, self.dilation = conv.padding, conv.stride, conv.dilation
        bias = ("bias",) if conv.bias is not None else ()
        self.spec = cudnn_graph.ConvSpec.of(conv.padding, conv.stride, conv.dilation, "fp8", ("scale",) + bias)
        self.spec_add = cudnn_graph.ConvSpec.of(conv.padding, conv.stride, conv.dilation, "fp8",
                                                ("scale",) + bias + ("add",))

    def forward(self, xq: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if xq.dtype != E4M3:
            raise InputError(f"FP8GraphConv reads the e4m3 output of the norm before it, got {xq.dtype} "
                             f"(its norm was not switched to FP8 output)")
        bias = None if self.bias is None else self.bias.view(1, -1, 1, 1).to(torch.float16)
        if residual is None:
            return cudnn_graph.conv2d(xq, self.weight_fp8, self.spec, self.descale, bias)
        return cudnn_graph.conv2d(xq, self.weight_fp8, self.spec_add, self.descale, bias,
                                  others=(residual.to(torch.float16),))

    def extra_repr(self) -> str:
        k, c = self.weight_fp8.shape[:2]
        return f"{c}, {k}, kernel_size={tuple(self.weight_fp8.shape[2:])}, fp8 e4m3, x_scale={self.x_scale:.3g}"


def resnets(decoder: nn.Module) -> list[tuple[str, GraphResnet]]:
    """The decoder's GraphResnet blocks whose two norms are FusedGroupNorms (the build this technique needs)."""
    return [(n, m) for n, m in decoder.named_modules()
            if isinstance(m, GraphResnet) and all(isinstance(n, FusedGroupNorm) for n in (m.norm1, m.norm2))
            and all(isinstance(c, GraphConv2d) for c in (m.conv1, m.conv2))]


def calibrate(decoder: nn.Module, batches: Iterable[torch.Tensor], call: Callable[[torch.Tensor], Any] | None = None
              ) -> dict[str, dict[str, Any]]:
    """Per block: the |x| max of conv1's and conv2's inputs over `batches` (run through `call`, default the
    decoder) and their shapes. Refuses (naming the conv) an input that stayed zero or went non-finite."""
    blocks = resnets(decoder)
    if not blocks:
        raise InputError("fp8_resnets needs the SD-VAE decoder after subpixel, fused_norm and graph_conv: no "
                         "GraphResnet with FusedGroupNorm norms found")
    seen: dict[str, dict[str, Any]] = {n: {"conv1": 0.0, "conv2": 0.0, "shape": None} for n, _ in blocks}
    hooks = []
    for name, blk in blocks:
        for conv in ("conv1", "conv2"):
            def hook(_m: nn.Module, args: tuple, name: str = name, conv: str = conv) -> None:
                x = args[0]
                seen[name][conv] = max(seen[name][conv], float(x.detach().abs().amax().float()))
                if conv == "conv1":
                    seen[name]["shape"] = tuple(x.shape)   # the block's input: what block_times rebuilds
            hooks.append(getattr(blk, conv).register_forward_pre_hook(hook))
    n = 0
    try:
        with torch.inference_mode():
            for z in batches:
                (call or decoder)(z)
                n += 1
    finally:
        for h in hooks:
            h.remove()
    if n == 0:
        raise InputError("fp8_resnets.calibrate: no calibration batches given")
    for name, s in seen.items():
        for conv in ("conv1", "conv2"):
            if not (s[conv] > 0 and math.isfinite(s[conv])):
                raise InputError(f"fp8_resnets.calibrate: {name}.{conv}'s input |x| max is {s[conv]!r} over {n} "
                                 f"batches; a static FP8 scale needs a finite, non-zero range")
    return seen


def fp8_resnets(decoder: nn.Module, amax: dict[str, dict[str, Any]], only: Sequence[str] | None = None
                ) -> list[dict[str, Any]]:
    """In place: each calibrated block (those in `only`, if given) gets FP8-output norms and FP8 convs; one row per
    block (its input shape, both scales, whether it became FP8)."""
    rows = []
    for name, blk in resnets(decoder):
        a = amax.get(name)
        on = a is not None and (only is None or name in only)
        row = {"block": name, "shape": "×".join(map(str, a["shape"])) if a and a["shape"] else "", "fp8": on,
               "amax_conv1": a and a["conv1"], "amax_conv2": a and a["conv2"],
               "reason": "" if on else ("not calibrated" if a is None else "kept fp16")}
        if on:
            s1, s2 = a["conv1"] / E4M3_MAX, a["conv2"] / E4M3_MAX
            object.__setattr__(blk, "fp16_parts", (blk.norm1, blk.conv1, blk.norm2, blk.conv2))
            blk.norm1, blk.conv1 = blk.norm1.fp8_output(s1), FP8GraphConv(blk.conv1, s1)
            blk.norm2, blk.conv2 = blk.norm2.fp8_output(s2), FP8GraphConv(blk.conv2, s2)
        rows.append(row)
    return rows


def plain_resnets(decoder: nn.Module) -> int:
    """Undo fp8_resnets in place (the fp16 norms and graph convs back); how many blocks were restored."""
    n = 0
    for _, blk in decoder.named_modules():
        parts = getattr(blk, "fp16_parts", None)
        if isinstance(blk, GraphResnet) and parts:
            blk.norm1, blk.conv1, blk.norm2, blk.conv2 = parts
            object.__delattr__(blk, "fp16_parts")
            n += 1
    return n


def _ms(fn: Callable[[], Any], iters: int = 20) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def block_times(decoder: nn.Module, amax: dict[str, dict[str, Any]], iters: int = 20) -> list[dict[str, Any]]:
    """Per calibrated block on a GPU: its two convs' time in fp16 (graph convs) and in FP8 (input already e4m3, as
    the norm writes it) on random input of the calibrated shape; ms per call, the mean of one timed loop of `iters`
    calls each (a choice between two kernels, not a reported figure)."""
    rows = []
    for name, blk in resnets(decoder):
        a = amax.get(name)
        if not a or not a["shape"]:
            continue
        n, c, h, w = a["shape"]
        dev = blk.conv1.weight.device
        x = torch.randn(n, c, h, w, device=dev, dtype=torch.float16).contiguous(memory_format=torch.channels_last)
        c1, c2 = FP8GraphConv(blk.conv1, 1.0), FP8GraphConv(blk.conv2, 1.0)
        xq = x.clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
        with torch.inference_mode():
            h16 = blk.conv1(x)
            hq = h16.clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
            fp16 = _ms(lambda: (blk.conv1(x), blk.conv2(h16, residual=h16)), iters)
            fp8 = _ms(lambda: (c1(xq), c2(hq, residual=h16)), iters)
        rows.append({"block": name, "shape": "×".join(map(str, a["shape"])), "fp16_ms": fp16, "fp8_ms": fp8,
                     "gain": fp16 / fp8 if fp8 > 0 else float("nan")})
    return rows


def keep_faster(times: Sequence[dict[str, Any]], min_gain: float = MIN_GAIN) -> list[str]:
    """The blocks whose FP8 convs ran at least `min_gain` times as fast as their fp16 ones."""
    return [r["block"] for r in times if r["gain"] >= min_gain]


__all__ = ["FP8GraphConv", "block_times", "calibrate", "fp8_resnets", "keep_faster", "plain_resnets", "resnets"]
