"""Convolutions as cuDNN operation graphs, module by module: the same function, fewer passes.

    rows = graph_convs(module)   # in place: diffusers ResNet blocks and every other eligible Conv2d
    plain_convs(module)          # undone (the same parameters back in the original modules)

Every plain conv (groups 1, zero padding, channel counts cuDNN's fp16 engines take: multiples of 8) becomes a
`GraphConv2d`: `lab.runtime.cudnn_graph` builds it once per shape, times cuDNN's ranked plans on the real
shapes and keeps the fastest, and adds the bias in the conv's fp32 epilogue. In each diffusers resnet block
(GroupNorm → SiLU → conv1 → GroupNorm → SiLU → conv2, plus the skip) the skip add moves into conv2's
epilogue too, so the block's output is written once instead of written by the conv, read back by the add
and written again. Under torch.compile the graph is an opaque op; Inductor fuses what is around it.

Exact up to fp16 rounding: the epilogue adds in fp32 and rounds once, where the torch path rounds the conv's
output before the adds. Inputs other than fp16 (a CPU run in fp32) take the plain torch ops, so the rewrite
is safe on any device; the speed only exists on a CUDA GPU with the cuDNN frontend. The techniques that name
it for a family live in `lab.techniques.graph_conv`.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lab.runtime import cudnn_graph


def eligible(conv: nn.Module) -> tuple[bool, str]:
    """Whether a conv can run as a graph conv, and why not."""
    if type(conv) is not nn.Conv2d:
        return False, f"{type(conv).__name__}, not a plain Conv2d"
    if conv.groups != 1 or isinstance(conv.padding, str) or conv.padding_mode != "zeros":
        return False, "grouped, 'same'-padded or non-zero-padded conv"
    if conv.in_channels % 8 or conv.out_channels % 8:
        return False, f"{conv.in_channels} → {conv.out_channels} channels (cuDNN's fp16 graphs take multiples of 8)"
    return True, ""


class GraphConv2d(nn.Module):
    """A Conv2d (the same parameters, shared) whose bias and optional residual add run in its epilogue."""

    adds_residual = True   # a block that checks for it hands its skip to the conv (LatentSync's ResnetBlock3D)

    def __init__(self, conv: nn.Conv2d):
        super().__init__()
        ok, why = eligible(conv)
        if not ok:
            raise ValueError(f"GraphConv2d: {why}")
        object.__setattr__(self, "plain", conv)   # unregistered: the state dict keeps Conv2d's keys; plain_convs undoes
        self.weight, self.bias = conv.weight, conv.bias
        self.stride, self.padding, self.dilation = conv.stride, conv.padding, conv.dilation
        bias = ("bias",) if conv.bias is not None else ()
        self.spec = cudnn_graph.ConvSpec.of(conv.padding, conv.stride, conv.dilation, epilogue=bias)
        self.spec_add = cudnn_graph.ConvSpec.of(conv.padding, conv.stride, conv.dilation, epilogue=bias + ("add",))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if x.dtype != torch.float16 or self.weight.dtype != torch.float16:
            y = F.conv2d(x, self.weight, self.bias, self.stride, self.padding, self.dilation)
            return y if residual is None else y + residual
        bias = None if self.bias is None else self.bias.view(1, -1, 1, 1)
        if residual is None:
            return cudnn_graph.conv2d(x, self.weight, self.spec, bias=bias)
        return cudnn_graph.conv2d(x, self.weight, self.spec_add, bias=bias, others=(residual.to(torch.float16),))

    def extra_repr(self) -> str:
        k, c = self.weight.shape[:2]
        return f"{c}, {k}, kernel_size={tuple(self.weight.shape[2:])}, padding={self.padding}, epilogue={self.spec.epilogue}"


class GraphResnet(nn.Module):
    """A diffusers ResnetBlock2D without a time embedding, its skip added in conv2's epilogue."""

    def __init__(self, blk: nn.Module):
        super().__init__()
        object.__setattr__(self, "plain", blk)
        self.norm1, self.norm2, self.nonlinearity, self.dropout = blk.norm1, blk.norm2, blk.nonlinearity, blk.dropout
        self.conv1, self.conv2 = _swap(blk.conv1), GraphConv2d(blk.conv2)
        self.conv_shortcut = None if blk.conv_shortcut is None else _swap(blk.conv_shortcut)

    def forward(self, x: torch.Tensor, temb: Any = None, *args: Any, **kwargs: Any) -> torch.Tensor:
        h = self.conv1(self.nonlinearity(self.norm1(x)))
        h = self.dropout(self.nonlinearity(self.norm2(h)))
        skip = x if self.conv_shortcut is None else self.conv_shortcut(x)
        return self.conv2(h, residual=skip)


def _swap(conv: nn.Module) -> nn.Module:
    return GraphConv2d(conv) if eligible(conv)[0] else conv


def _resnet_ok(blk: nn.Module) -> tuple[bool, str]:
    if blk.time_emb_proj is not None or blk.upsample is not None or blk.downsample is not None:
        return False, "has a time embedding or resamples inside the block"
    if float(blk.output_scale_factor) != 1.0:
        return False, f"output_scale_factor {blk.output_scale_factor} (the skip add would be rescaled)"
    ok, why = eligible(blk.conv2)
    return ok, (f"conv2: {why}" if why else "")


def require_for(module: nn.Module) -> None:
    """A module on a CUDA device: BackendUnavailable now (the wheel, the GPU) rather than at its first call."""
    p = next(iter(module.parameters()), None)
    if p is not None and p.is_cuda:
        cudnn_graph.require(p.device, "fp16")


def _set(root: nn.Module, name: str, mod: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, leaf, mod)


def graph_convs(module: nn.Module) -> list[dict[str, Any]]:
    """Swap, in place, each diffusers ResnetBlock2D for a GraphResnet and every other eligible Conv2d for a
    GraphConv2d; one report row per place considered (what it became, or why it stayed)."""
    from diffusers.models.resnet import ResnetBlock2D

    require_for(module)
    rows: list[dict[str, Any]] = []
    for name, mod in list(module.named_modules()):
        if isinstance(mod, ResnetBlock2D):
            ok, why = _resnet_ok(mod)
            if ok:
                _set(module, name, GraphResnet(mod))
            rows.append({"module": name, "became": "GraphResnet (skip in conv2's epilogue)" if ok else "", "reason": why})
    for name, mod in list(module.named_modules()):
        if isinstance(mod, nn.Conv2d) and name:
            ok, why = eligible(mod)
            if ok:
                _set(module, name, GraphConv2d(mod))
            rows.append({"module": name, "became": "GraphConv2d" if ok else "", "reason": why})
    return rows


def plain_convs(module: nn.Module) -> int:
    """Undo graph_convs in place (the same parameters back in the original modules); how many places were restored."""
    n = 0
    for cls in (GraphResnet, GraphConv2d):   # blocks first: a block's own graph convs go back with it
        for name, mod in list(module.named_modules()):
            if isinstance(mod, cls) and name and module.get_submodule(name) is mod:
                _set(module, name, mod.plain)
                n += 1
    return n


__all__ = ["GraphConv2d", "GraphResnet", "eligible", "graph_convs", "plain_convs", "require_for"]
