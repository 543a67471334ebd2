"""The cuDNN graph convs (`lab.runtime.conv_graphs`) as each family's `graph_conv` technique.

    rows = graph_convs(vae.model.decoder)   # MuseTalk's SD-VAE decoder, in place; after `subpixel` and `fused_norm`
    rows = graph_spade(fused_decoder)       # Ditto's merged SPADE decoder (`fuse_spade`), in place

Each conv becomes a cuDNN graph-API fp16 conv with its bias in the epilogue; a block's skip add moves into its last
conv's epilogue (diffusers ResNet blocks; Ditto's SPADE blocks, with a folded shortcut's β), so the block's output
is written once. The same function up to fp16 rounding; off CUDA or in fp32 the torch ops.
"""
from __future__ import annotations

from typing import Any

from torch import nn

from lab.runtime import conv_graphs
from lab.runtime.conv_graphs import GraphConv2d, GraphResnet, eligible, plain_convs, require_for
from lab.techniques import technique

CUDNN_PROBE = "lab.runtime.cudnn_graph:available"   # a preset runs its convs as cuDNN graphs where the frontend runs


@technique("graph_conv", family="musetalk", exact=True, hardware=CUDNN_PROBE,
           doc="SD-VAE decoder: each conv a cuDNN graph-API fp16 conv (plans timed per shape) with its bias and, "
               "in the resnet blocks, the skip add in the conv's epilogue (the same function up to fp16 rounding; "
               "the torch ops off CUDA or in fp32).")
def graph_convs(module: nn.Module) -> list[dict[str, Any]]:
    """`lab.runtime.conv_graphs.graph_convs`: in place, one report row per place considered."""
    return conv_graphs.graph_convs(module)


@technique("graph_conv", family="ditto", exact=True, requires=("fuse_spade",), hardware=CUDNN_PROBE,
           doc="The merged SPADE decoder's convs as cuDNN graph-API fp16 convs (plans timed per shape), each block's "
               "skip add (and a folded shortcut's β) in its last conv's epilogue, on a GPU the decoder channels-last (the graphs "
               "take NHWC operands); the same function up to fp16 rounding (the torch ops off CUDA or in fp32).")
def graph_spade(decoder: nn.Module) -> list[dict[str, Any]]:
    """In place on a FusedSPADEDecoder (lab.techniques.spade_fuse): every eligible conv of its blocks a GraphConv2d,
    and a block whose conv_1 (and conv_s, if its shortcut is folded) became one adds its skip there."""
    from lab.techniques.spade_fuse import FusedBlock

    require_for(decoder)
    rows: list[dict[str, Any]] = []
    for name, blk in list(decoder.named_modules()):
        if not isinstance(blk, FusedBlock):
            continue
        convs = ["conv_0", "conv_1"] + (["conv_s"] if blk.learned_shortcut else [])
        for c in convs:
            ok, why = eligible(getattr(blk, c))
            if ok:
                setattr(blk, c, GraphConv2d(getattr(blk, c)))
            rows.append({"module": f"{name}.{c}", "became": "GraphConv2d" if ok else "", "reason": why})
        for i, gb in enumerate(blk.gb):
            ok, why = eligible(gb)
            if ok:
                blk.gb[i] = GraphConv2d(gb)
            rows.append({"module": f"{name}.gb.{i}", "became": "GraphConv2d" if ok else "", "reason": why})
    return rows


__all__ = ["GraphConv2d", "GraphResnet", "eligible", "graph_convs", "graph_spade", "plain_convs", "require_for"]
