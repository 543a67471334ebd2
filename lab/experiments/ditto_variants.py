"""Notebook 06's renderer variants: each a precision, a runtime and renderer techniques (Config changes), with
what each is, which the full profile times, and which are held against upstream's code; and the helpers that
swap techniques in a row's Config changes.
"""
from __future__ import annotations

from lab.pipelines import ditto as P
from lab.pipelines import engine_notes


def _variant(precision: str, runtime: str, *techniques: str) -> dict:
    """A renderer variant as Config changes: its precision, its runtime and its renderer techniques."""
    return dict(precision=precision, runtime=runtime, techniques=techniques)


FOLD, CL, PAD, CL3D, FUSE = "fold_spectral_norm", "channels_last", "pad_channels", "channels_last_3d", "fuse_spade"
FFT, TAP, MIX, LOWSEG, SC = "fft_mask", "tap_occlusion", "fused_mix", "lowres_seg", "fold_shortcut"
CG = "compile+graph"
BEST = "compile+graph+pad8+fuse+fft+tap+mix+lowseg+sc"   # the exact preset's renderer (tested equal)
VARIANTS = {
    "upstream": _variant("autocast", "eager"),
    "fp16+fold-nchw": _variant("fp16", "eager", FOLD),
    "fp16+fold": _variant("fp16", "eager", FOLD, CL),
    "fp16+fold+graph": _variant("fp16", "graph", FOLD, CL),
    "fp16+pad8+graph": _variant("fp16", "graph", FOLD, PAD),
    "compile": _variant("fp16", "compile", FOLD, CL),
    "compile+graph": _variant("fp16", CG, FOLD, CL),
    "compile+graph+pad8": _variant("fp16", CG, FOLD, CL, PAD),
    "fp16+cl3d+graph": _variant("fp16", "graph", FOLD, CL, CL3D),
    "fp16+fuse+cl3d+graph": _variant("fp16", "graph", FOLD, CL, CL3D, FUSE),
    "compile+graph+fuse+cl3d": _variant("fp16", CG, FOLD, CL, CL3D, FUSE),
    "fp16+pad8+fuse+graph": _variant("fp16", "graph", FOLD, PAD, FUSE),
    "compile+graph+pad8+fuse": _variant("fp16", CG, FOLD, PAD, FUSE),
    "fp16+pad8+fuse+fft+graph": _variant("fp16", "graph", FOLD, PAD, FUSE, FFT),
    "compile+graph+pad8+fuse+fft": _variant("fp16", CG, FOLD, PAD, FUSE, FFT),
    "compile+graph+pad8+fuse+fft+cl3d": _variant("fp16", CG, FOLD, PAD, CL3D, FUSE, FFT),
    "compile+graph+pad8+fuse+fft+tap": _variant("fp16", CG, FOLD, PAD, FUSE, FFT, TAP),
    "compile+graph+pad8+fuse+fft+tap+mix": _variant("fp16", CG, FOLD, PAD, FUSE, FFT, TAP, MIX),
    "compile+graph+pad8+fuse+fft+tap+mix+lowseg": _variant("fp16", CG, FOLD, PAD, FUSE, FFT, TAP, MIX, LOWSEG),
    BEST: _variant("fp16", CG, FOLD, PAD, FUSE, FFT, TAP, MIX, LOWSEG, SC),
    "compile+graph+pad8+fuse+fft+tap+mix+cl3d": _variant("fp16", CG, FOLD, PAD, CL3D, FUSE, FFT, TAP, MIX),
    "compile+graph+pad8+fuse+fft+cl": _variant("fp16", CG, FOLD, CL, PAD, FUSE, FFT),
    BEST + "+gconv": _variant("fp16", CG, FOLD, PAD, FUSE, FFT, TAP, MIX, LOWSEG, SC, "graph_conv"),
    BEST + "+fp8": _variant("fp16", CG, FOLD, PAD, FUSE, FFT, TAP, MIX, LOWSEG, SC, "fp8_conv"),
}


def exact(name: str) -> bool:
    """Whether a variant computes upstream's function (every technique of it exact): the others are never the
    'best' renderer the exact rows build on."""
    from lab.techniques import registry

    known = registry("ditto")
    return all(known[t].exact for t in VARIANTS[name]["techniques"])


def _compiles(v: dict) -> bool:
    return "compile" in v["runtime"]


def _graphs(v: dict) -> bool:
    return "graph" in v["runtime"]


def with_techniques(changes: dict, add: tuple[str, ...] = (), drop: tuple[str, ...] = ()) -> dict:
    """Config changes with techniques added (in order, once) and dropped."""
    kept = [t for t in changes.get("techniques", ()) if t not in drop and t not in add]
    return changes | {"techniques": tuple(kept) + tuple(add)}


def with_renderer(changes: dict, variant: dict) -> dict:
    """Config changes with the renderer (precision, runtime, renderer techniques) swapped for `variant`'s."""
    return with_techniques(changes | {"precision": variant["precision"], "runtime": variant["runtime"]},
                           tuple(variant["techniques"]), P.RENDERER_TECHNIQUES)


VARIANT_TEXT = {
    "upstream": "upstream's precision: fp32 weights under fp16 autocast, spectral-norm hooks, NCHW, eager",
    "fp16+fold-nchw": "fp16 weights, spectral norm folded into the conv weights once, NCHW, eager",
    "fp16+fold": "the same with the decoder's convs channels-last",
    "fp16+fold+graph": "the same captured into one CUDA graph per batch size",
    "compile": "the same through torch.compile (inductor, default mode)",
    "compile+graph": "the compiled renderer captured into a CUDA graph",
    "fp16+pad8+graph": "fp16, folded, NCHW, conv channels zero-padded to multiples of 8 (142 → 144, 22 → 24, 110 → 112), CUDA graph",
    "compile+graph+pad8": "compile + CUDA graph with the channel padding",
    "fp16+cl3d+graph": "fp16, folded, the warp network's 3-D convs channels-last (NDHWC), decoder channels-last, CUDA graph",
    "fp16+fuse+cl3d+graph": "the same with the SPADE modulation convs merged (one 3×3 conv per resolution, γβ as one conv)",
    "compile+graph+fuse+cl3d": "merged SPADE convs, NDHWC 3-D convs, torch.compile (default mode), CUDA graph",
    "fp16+pad8+fuse+graph": "fp16, folded, NCHW, dense-motion channels padded to 8, merged SPADE convs, CUDA graph",
    "compile+graph+pad8+fuse": "the same through torch.compile (default mode), CUDA graph",
    "fp16+pad8+fuse+fft+graph": "fp16+pad8+fuse+graph with the 7³ mask conv through FFTs in fp32 (lab.techniques.fft_conv), CUDA graph",
    "compile+graph+pad8+fuse+fft": "the same through torch.compile (default mode), CUDA graph",
    "compile+graph+pad8+fuse+fft+cl3d": "the same with the dense motion's 3-D convs channels-last (NDHWC), padded ones included",
    "compile+graph+pad8+fuse+fft+tap": "compile+graph+pad8+fuse+fft with the 1-channel occlusion conv as one matmul + shifted sum "
                                       "(lab.techniques.tap_conv)",
    "compile+graph+pad8+fuse+fft+tap+mix": "the same with the 22-way motion mix as multiply + sum (fused with the softmax)",
    "compile+graph+pad8+fuse+fft+tap+mix+lowseg": "compile+graph+pad8+fuse+fft+tap+mix with the 128² and 256² SPADE shared "
                                                   "convs computed on the 64² segmap they are upsampled from (lab.techniques."
                                                   "nearest_conv: 16/36 and 36/144 of the taps, the same function)",
    "compile+graph+pad8+fuse+fft+tap+mix+lowseg+sc": "the same with each learned shortcut's 1×1 conv composed into its "
                                                      "norm's β conv (fin − fout of its channels never computed)",
    "compile+graph+pad8+fuse+fft+tap+mix+cl3d": "the same with the dense motion's 3-D convs channels-last (NDHWC)",
    "compile+graph+pad8+fuse+fft+cl": "compile+graph+pad8+fuse+fft with the decoder's 2-D convs channels-last",
    BEST + "+gconv": "the exact preset's renderer with the merged decoder's convs as cuDNN graph convs, each block's "
                     "skip add in its last conv's epilogue (lab.runtime.conv_graphs; the same function)",
    BEST + "+fp8": "approximate: the exact preset's renderer with the merged decoder's convs in cuDNN FP8, static "
                   "activation scales, each conv FP8 only where its kernel beat fp16's when built and while the faces "
                   "stay within 50 dB of the fp16 decoder's (lab.techniques.fp8_static); its PSNR is a bound on the "
                   "arithmetic with random weights, never the best exact renderer",
}


# measured before on the H200 at B = 16: NDHWC 3-D convs slower (123 vs 129 FPS), NCHW + channel padding faster
# (161; `fp16+fold-nchw` separates the layout from the padding): the full profile keeps the variants that can
# still win, the others stay in VARIANTS for the notebook (later: NDHWC also slower with the FFT mask conv, 357.0 vs
# 364.9 FPS; a channels-last decoder slower, 320.3 vs 321.1)
FULL_VARIANTS = ["upstream", "fp16+fold-nchw", "fp16+fold+graph", "fp16+pad8+graph", "fp16+pad8+fuse+graph",
                 "fp16+pad8+fuse+fft+graph", "compile+graph", "compile+graph+pad8+fuse", "compile+graph+pad8+fuse+fft",
                 "compile+graph+pad8+fuse+fft+tap", "compile+graph+pad8+fuse+fft+tap+mix",
                 "compile+graph+pad8+fuse+fft+tap+mix+lowseg", BEST, BEST + "+gconv", BEST + "+fp8"]


# the renderer variants held against upstream's code (lab.parity.ditto.renderer_agreement): upstream's runtime,
# the plain fp16 graph, the fastest eager graph and the fastest exact variant
AGREEMENT_VARIANTS = ["upstream", "fp16+fold+graph", "fp16+pad8+fuse+fft+graph", "compile+graph+pad8+fuse+fft+tap+mix+lowseg+sc"]


def renderer_notes(engine: P.Engine) -> str:
    """What a renderer variant left as it was (layers off a graph conv's or FP8 conv's shapes, shapes cuDNN declined)."""
    return "; ".join(engine_notes(engine.cfg.techniques, engine.notes, P.config.CUDNN_TECHNIQUES))
