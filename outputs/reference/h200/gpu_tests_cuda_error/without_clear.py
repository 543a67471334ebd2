"""The failed-registration test's steps with lab.video.clear_cuda_error made a no-op: the conv after it must raise
the stale error (so the test can fail), and with the function in place it must not."""
import torch

import lab.video as V

real = torch.cuda.cudart()


class Failing:
    def cudaHostRegister(self, ptr, n, flags):
        return real.cudaHostRegister(ptr, n, 0xFFFF)


def attempt(clear) -> str:
    saved_rt, saved_clear = torch.cuda.cudart, V.clear_cuda_error
    torch.cuda.cudart, V.clear_cuda_error = (lambda: Failing()), clear
    try:
        _, how = V.host_buffer((2, 64, 64), torch.uint8, True, True)
    finally:
        torch.cuda.cudart, V.clear_cuda_error = saved_rt, saved_clear
    try:
        x = torch.randn(2, 3, 16, 16, device="cuda")
        torch.nn.functional.conv2d(x, torch.randn(4, 3, 3, 3, device="cuda"))
        torch.cuda.synchronize()
        return f"{how}; next kernel ran"
    except RuntimeError as e:
        return f"{how}; next kernel raised: {str(e).splitlines()[0][:120]}"


print("without clearing:", attempt(lambda: None))
V.clear_cuda_error()
print("with clearing:   ", attempt(V.clear_cuda_error))
print("runtime found:", V._loaded_cudart())
