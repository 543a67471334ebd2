"""How a module executes: eager, torch.compile, CUDA graphs, ONNX Runtime, TensorRT (`backends`), the
on-disk cache of built artifacts (`cache`) and programmatic dependent launch for the lab's Triton
kernels (`pdl`)."""
