"""SpeechBrain, imported without changing torch's process-wide settings.

``import speechbrain`` applies its "quirks" (``speechbrain.utils.quirks``): TF32 matmuls and
convolutions on (``float32_matmul_precision`` from highest to high) and TorchScript's profiling
executor off, for the whole process. A researcher who uses tta-brain's scoring or methods in
their own script would have their own CUDA matmuls run in TF32 from then on without a word. Every
tta-brain module that imports SpeechBrain imports this one first: the first import of SpeechBrain
in the process happens here, and the settings are put back as they were. A run decides TF32
itself (the run block's ``tf32``, :func:`tta_brain.lobes.runtime.process_settings`).
"""
import torch


def _jit_profiling():
    executor = torch._C._jit_set_profiling_executor(True)
    torch._C._jit_set_profiling_executor(executor)
    mode = torch._C._jit_set_profiling_mode(True)
    torch._C._jit_set_profiling_mode(mode)
    return executor, mode


def _precision():
    """``torch.get_float32_matmul_precision()``; None where torch refuses to say (it raises once
    the legacy ``allow_tf32`` flags and the newer precision API were both used)."""
    try:
        return torch.get_float32_matmul_precision()
    except RuntimeError:
        return None


def settings():
    """The process-wide torch settings SpeechBrain's import changes."""
    return (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
            _precision(), _jit_profiling())


def restore(saved) -> None:
    cuda_tf32, cudnn_tf32, precision, (executor, mode) = saved
    torch.backends.cuda.matmul.allow_tf32 = cuda_tf32
    torch.backends.cudnn.allow_tf32 = cudnn_tf32
    if precision is not None:
        torch.set_float32_matmul_precision(precision)
    torch._C._jit_set_profiling_executor(executor)
    torch._C._jit_set_profiling_mode(mode)


_saved = settings()
try:
    import speechbrain  # noqa: F401,E402
finally:
    restore(_saved)
