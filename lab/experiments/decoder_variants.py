"""Notebook 02's SD-VAE / TAESD decoder variants: what each one is and how it is built.

    VARIANTS[name]       one line on what the variant changes
    COMPILE_MODE[name]   torch.compile's mode for a compiled variant (COMPILED: those names)
    SUBPIXEL[name]       the upsampler fold (lab.techniques.subpixel) a variant runs on
    REWRITE[name]        the lab.techniques rewrites applied to the folded decoder, in order
    GRAPHED              the variants that run in a CUDA graph (CUDA-graph trees or one captured decode)

`lab.experiments.decoders.build_decoder` turns a name into a callable; `skip_reason` says where one cannot run.
"""
from __future__ import annotations

# Every variant is meant to compute the same function (notebook 02 scores each against strict fp32 and keeps a row
# under 50 dB off the best rows); they differ in memory layout, kernel choice, FLOPs and launch overhead. Order
# matters: cheap ones first, compiles last (they can run out of budget).
VARIANTS: dict[str, str] = {
    "eager": "diffusers module as shipped (NCHW, cudnn.benchmark off)",
    "channels_last": "NHWC weights + inputs: cuDNN's tensor-core convs need no transposes",
    "cudnn_benchmark": "channels_last + cudnn.benchmark=True (cuDNN times its algorithms once per shape)",
    "cuda_graph": "channels_last + cudnn.benchmark, whole decode captured in one CUDA graph (no launch overhead)",
    "compile": "torch.compile default mode (Inductor fuses GroupNorm/SiLU/adds), channels_last + cudnn.benchmark",
    "compile_cudagraphs": "torch.compile mode='reduce-overhead' (Inductor + CUDA graphs)",
    "compile_autotune": "torch.compile mode='max-autotune-no-cudagraphs' (autotunes GEMM/conv templates; minutes)",
    # the same function with fewer FLOPs: nearest-2x + 3x3 conv folded into a stride-2 4x4 transposed
    # conv (lab.techniques.subpixel); exact up to summation order, PSNR vs fp32 shown on the row
    "subpixel": "cudnn_benchmark + upsample convs folded into stride-2 transposed convs (2.25x fewer FLOPs there)",
    "compile_subpixel": "compile_cudagraphs on the subpixel-folded decoder (one conv_transpose2d per upsampler)",
    "compile_subpixel_phases": "compile_cudagraphs on the subpixel-folded decoder (four 2x2 phase convs as one conv)",
    "compile_subpixel_frozen": "compile_subpixel + Inductor freezing (weights as constants) + 1x1 convs as matmuls "
                               "(fusable epilogues: the shortcut conv and the residual add in one kernel)",
    "compile_subpixel_groupnorm": "compile_subpixel with GroupNorm + SiLU as channels-last Triton passes "
                                  "(lab.techniques.group_norm: statistics over whole pixel rows, conv1's bias taken in)",
    "compile_subpixel_autotune": "compile_subpixel with mode='max-autotune' (Triton conv/GEMM templates vs cuDNN "
                                 "per shape, + CUDA graphs; minutes of compile)",
    "compile_subpixel_graph": "compile_subpixel_groupnorm, each conv a cuDNN graph-API conv (lab.techniques.graph_conv: "
                              "plans timed per shape; bias and the resnet skip add in the conv's epilogue)",
    # the same kernels without inductor around them: the norms and convs are the lab's own, so a CUDA graph of the
    # eager module loses only the few pointwise ops inductor would fuse (the scale, the attention's adds, the clamp)
    "cuda_graph_subpixel_graph": "compile_subpixel_graph's decoder (subpixel, Triton GroupNorm passes, cuDNN graph "
                                 "convs) without torch.compile: its eager ops captured in one CUDA graph",
}
COMPILE_MODE = {"compile": "default", "compile_cudagraphs": "reduce-overhead", "compile_autotune": "max-autotune-no-cudagraphs",
                **{v: "max-autotune" if v.endswith("autotune") else "reduce-overhead" for v in VARIANTS
                   if v.startswith("compile_subpixel")}}
COMPILED = tuple(COMPILE_MODE)
SUBPIXEL = {v: "phases" if v.endswith("phases") else "transpose" for v in VARIANTS if "subpixel" in v}
INDUCTOR = {"compile_subpixel_frozen": {"freezing": True, "conv_1x1_as_mm": True}}  # patched while it compiles
GRAPHED = ("cuda_graph", "cuda_graph_subpixel_graph") + tuple(v for v, m in COMPILE_MODE.items()
                                                            if m in ("reduce-overhead", "max-autotune"))
NO_GRAPH = {"reduce-overhead": "default", "max-autotune": "max-autotune-no-cudagraphs"}   # the same, graphs off
# the rewrites a variant applies to the (folded) decoder before compiling or capture: lab.techniques module, function
REWRITE = {"compile_subpixel_groupnorm": [("group_norm", "fuse_group_norms")],
           "compile_subpixel_graph": [("group_norm", "fuse_group_norms"), ("graph_conv", "graph_convs")]}
CUDNN_GRAPH = ("compile_subpixel_graph", "cuda_graph_subpixel_graph")   # the variants that need cuDNN's graph API
REWRITE["cuda_graph_subpixel_graph"] = REWRITE["compile_subpixel_graph"]
