"""How a module executes: eager, torch.compile, CUDA graphs, ONNX Runtime, TensorRT (`backends`), the
on-disk cache of built artifacts (`cache`), programmatic dependent launch for the lab's Triton
kernels (`pdl`), cuDNN's graph API (`cudnn_graph`, surveyed by `cudnn_survey`) and a Triton conv that normalizes
in its prologue, with its survey against cuDNN (`norm_conv`)."""
