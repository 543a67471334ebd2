"""Fold spectral normalization into plain conv weights once, at load.

In eval mode a spectral-norm conv divides its stored weight by σ = uᵀ W v (u, v from the
checkpoint, no power iteration) on *every* forward: a matrix-vector product and a division per
conv per call, and a weight tensor recomputed each time. σ is a constant of the checkpoint, so
W / σ can be computed once: the same function, fewer kernels per frame, and plain `weight`
parameters that compilers and graph capture see as constants.
"""
from __future__ import annotations

import torch
from torch import nn
from lab.techniques import technique


def has_spectral_norm(module: nn.Module) -> bool:
    return any(hasattr(m, "weight_orig") for m in module.modules())


@technique("fold_spectral_norm", family="ditto", exact=True,
           doc="The decoder's spectral norm (σ = uᵀWv) folded into plain conv weights once: the same function, "
               "no hook per forward.")
def fold_spectral_norm(module: nn.Module) -> int:
    """Replace every (old-style) spectral-norm hook in `module` by its eval-mode weight, in place.
    Returns how many were folded. After folding, `state_dict()` has plain `weight` keys."""
    n = 0
    for m in module.modules():
        hooks = [h for h in m._forward_pre_hooks.values()
                 if type(h).__name__ == "SpectralNorm"]
        for h in hooks:
            # torch's remove computes W_orig / (uᵀ W v) without a power iteration: the eval weight
            torch.nn.utils.remove_spectral_norm(m, h.name)
            n += 1
    return n
