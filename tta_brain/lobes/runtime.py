"""How the passes run: precision, ``torch.compile``, the per-utterance CNN feature cache and the CPU
backward kernels. One small object, owned by the lobe; methods ask it, they do not configure it.

Only ``precision`` changes the numbers, and ``convolutions: gemm`` their last bits (the same sums
in another order); the other options are exact (tests compare them with the plain paths,
``tools/bench_speed.py`` measures them). ``cuda_graphs`` (CUDA only, ``auto`` by
default; measured in the README's GPU section) runs the SUTA family's adaptation steps without
host syncs, replayed from captured graphs (``tta_brain.gpu``).
"""
import ctypes
import ctypes.util
import os
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import List, Optional, Sequence, Union

import torch

__all__ = ["Runtime", "FeatureCache", "PRECISIONS", "AUTO_BUCKETS", "AUTO_BUCKET_CACHE",
           "native_cpu_kernels", "release_freed_memory", "free_run_memory",
           "deterministic_kernels", "tf32_kernels", "TF32_MODES", "process_settings",
           "check_default_dtype"]

def check_default_dtype(where: str) -> None:
    """A ValueError naming ``where`` unless torch's default dtype is float32: the models load and
    the methods make their tensors in it (``torch.set_default_dtype(torch.float64)`` in a user's
    script loaded a float64 model that float32 inputs then met: a traceback deep in a layer;
    ``--precision`` is how a run chooses another)."""
    if torch.get_default_dtype() != torch.float32:
        raise ValueError(f"{where}: torch's default dtype is {torch.get_default_dtype()} "
                         f"(torch.set_default_dtype): tta-brain's models and methods run in "
                         f"float32; set it back with torch.set_default_dtype(torch.float32)")


PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
#: ``cuda_graph_buckets: auto`` on CUDA: the ratio measured on an H200 (2026-11-27, two sessions:
#: 1.3-2.1x faster than the unbucketed captured step through decode, the same transcripts;
#: README, GPU)
AUTO_BUCKETS = 0.1
#: ``cuda_graph_cache: auto`` on length buckets: two step graphs (DSUTA's first step, with its
#: slow-gradient hook, and the others) for each of the 32 buckets of 1-20 s at ratio 0.1
AUTO_BUCKET_CACHE = 64


@dataclass
class Runtime:
    """Runtime options of a lobe's passes.

    precision : "fp32" | "bf16" | "fp16"
        Autocast of the model forward (losses in float32). fp16 backpropagates
        ``loss * loss_scale`` (default 2**12) and unscales the gradients before the checks and the
        update. Changes the numerics: check the WER before relying on it.
    compile : bool
        ``torch.compile`` the model forward (dynamic shapes; meant for GPUs).
    cache_features : "auto" | "on" | "off"
        Run the CNN feature encoder once per utterance and every pass of that utterance
        (adaptation steps, prediction, LII losses) from its output. Exact (bit-identical logits)
        when no adapted parameter is in the feature encoder, so ``auto`` turns it on exactly then
        (in train mode too where the feature encoder draws nothing: no dropout module, no batch
        norm, as in the wav2vec 2.0 family; AWMC's default); with the paper's ``layernorm + cnn``
        selection it is off.
    cpu_native_backward : bool
        On CPU, run the backward with oneDNN off (PyTorch's own convolution kernels). oneDNN builds
        its convolution-backward kernels for every new input length, which on a real stream costs
        about one extra backward per utterance; the native kernels need no per-length set-up.
        Gradients agree to rounding. No effect on GPU.
    cuda_graphs : "auto" | "on" | "off"
        CUDA only (see README, "GPU"; ``tta_brain.gpu.make_step`` chooses a method's step once).
        ``auto`` (default): the adaptation steps of methods whose loss runs on the device alone
        (suta, csuta, dsuta, tent, eata, sar, cea) are captured as CUDA graphs wherever that is
        exact (fp32, no ``compile``, no train mode that draws dropout, LayerDrop, SpecAugment or
        batch statistics: ``tta_brain.gpu.train_draws``) and replayed for the utterance's
        remaining steps, with the finiteness check on the device and torch's fused AdamW (no
        host sync inside a step; rounding differs from the host step's ``foreach`` AdamW);
        elsewhere the host step.
        ``on``: the same, and says why where it cannot capture; ``off``: never captured. The first
        ``cuda_graph_warmup`` steps of a new length run eagerly (and 3 in all before the first
        capture); they are real steps, so an utterance still gets N. A batched sweep's step
        (``tta_brain.sweep``: suta, csuta, tent, dsuta, eata, cea) is captured the same way, per
        set of runs that step together (``tta_brain.gpu.batch_graphs``; on length buckets too).
        No effect on CPU.
    cuda_device_steps : bool
        CUDA only: the device-side check and fused AdamW also where the steps are not captured
        (``cuda_graphs: off``, bf16/fp16, ``compile``).
    cuda_graph_cache : "auto" | int
        Captured graphs kept (LRU; one shared memory pool). ``auto`` (default): 64 on length
        buckets (two step graphs, DSUTA's first step and the others, for each of the 32 buckets
        of 1-20 s at ratio 0.1), else 1. Without buckets a stream of distinct lengths captures
        once per utterance whatever the size; a length seen again while still cached replays
        without a new capture. Above 1, an older graph may be replayed after newer ones were
        captured into the same pool, which is safe only because a capture leaves nothing alive in
        the pool (``tta_brain.gpu.graphs``); ``tools/gpu_check.py`` checks it with 4.
    cuda_graph_warmup : int
        Eager steps of a new length before it is captured (default 1). 0: once the first 3
        steps of the run have run eagerly, a new length is captured at once (no eager step per
        utterance; on an H100 faster for SUTA and slower for DSUTA + dynamic, so not the default;
        ``tools/gpu_check.py`` checks that it replays the eager transcripts).
    convolutions : "native" | "gemm"
        How the CNN feature encoder's convolutions run: ``native`` (default: torch's
        ``conv1d``, cuDNN on CUDA, oneDNN or PyTorch's own kernels on CPU) or ``gemm``: each as
        one matrix product of its input's windows and its weight (``tta_brain.lobes.gemm_conv``;
        wav2vec 2.0-style models only). The same sums in another order: logits and gradients
        equal to rounding, not bit for bit. A candidate for the GPU step, whose cuDNN
        convolutions took about half its kernel time on an H200; its speed there is unmeasured
        (``tools/gpu_check.py``: ``official``, ``convolutions``), on CPU it is no faster. Under
        ``tf32: torch`` (the default) its products run in fp32 where cuDNN's convolutions run in
        TF32.
    cuda_graph_buckets : "auto" | float
        Length buckets of the captured steps. ``auto`` (default): ratio 0.1 on CUDA where the
        padded pass is exact (below), off elsewhere and on CPU (:meth:`bucket_ratio`); 0: off.
        With ``r > 0`` every plain step of
        an utterance runs on its input zero-padded to the next bucket (edges ``1 s * (1 + r)^k``,
        on the CNN's stride), with its valid length as a device tensor
        (``tta_brain.lobes.partial``: the padding is masked exactly), so one captured graph serves
        every length of its bucket: a new utterance replays from its first step without a warm-up
        or a capture. Only where the padded pass is exact (wav2vec2 and HuBERT encoders, group- or
        layer-norm CNNs, no adapter; the skeleton's SUTA loss; see ``padding_blocker``); the
        logits equal the unpadded ones to rounding, not bit for bit (on an H200: the same
        transcripts, weights within 1.4e-5; README, GPU). Give ``cuda_graph_cache``
        room for the buckets a stream visits (about ``ln(longest / 1 s) / ln(1 + r)``).

    The values follow the yaml rules (``tta_brain.hparams.RULES``), which check a yaml's before
    anything is built; a ``Runtime`` built in Python checks its own against the same rules (one
    ValueError naming the option: ``cuda_graph_cache=0`` had failed later, on CUDA only, in the
    graph cache).
    """

    precision: str = "fp32"
    compile: bool = False
    cache_features: str = "auto"
    cpu_native_backward: bool = True
    loss_scale: Optional[float] = None
    cuda_graphs: str = "auto"
    cuda_device_steps: bool = False
    cuda_graph_cache: Union[str, int] = "auto"
    cuda_graph_warmup: int = 1
    cuda_graph_buckets: Union[str, float] = "auto"
    convolutions: str = "native"

    def __post_init__(self):
        from tta_brain.hparams import rules     # (the yamls' rules: torch-free, read here)
        for key in self.__dataclass_fields__:
            value = getattr(self, key)
            if hasattr(value, "item") and getattr(value, "shape", None) == ():
                value = value.item()          # a numpy or torch scalar, as build_method takes
                setattr(self, key, value)
            kind, rng = rules.RULES.get(key, (None, None))
            if kind is not None and not rules.valid_value(value, kind, rng):
                raise ValueError(f"Runtime({key}={value!r}): {key} must be "
                                 f"{rules.expected(kind, rng)}")
        self.dtype = PRECISIONS[self.precision]
        self.scale = float(self.loss_scale if self.loss_scale is not None
                           else 2.0 ** 12 if self.precision == "fp16" else 1.0)

    def bucket_ratio(self, device_type: str) -> float:
        """The length-bucket ratio asked for on a ``device_type`` device: ``auto`` is
        :data:`AUTO_BUCKETS` on CUDA and 0 (off) elsewhere; the method's step still refuses
        buckets where the padded pass is not exact (``tta_brain.gpu.bucket_blocker``)."""
        if self.cuda_graph_buckets == "auto":
            return AUTO_BUCKETS if device_type == "cuda" else 0.0
        return float(self.cuda_graph_buckets)

    def graph_cache(self, buckets: float) -> int:
        """Captured graphs kept when the steps run on ``buckets`` (0: off): ``auto`` is
        :data:`AUTO_BUCKET_CACHE` on buckets, else 1."""
        if self.cuda_graph_cache == "auto":
            return AUTO_BUCKET_CACHE if buckets else 1
        return int(self.cuda_graph_cache)

    def autocast(self, device_type: str):
        """The forward's autocast context (a no-op in fp32)."""
        if self.dtype is None:
            return nullcontext()
        return torch.autocast(device_type, dtype=self.dtype)

    def _scaled_backward(self, loss, params, device) -> List[torch.Tensor]:
        """``(loss * scale).backward()`` (oneDNN off on CPU when asked); the gradients, scaled."""
        if self.scale != 1.0:
            loss = loss * self.scale
        if self.cpu_native_backward and device.type == "cpu":
            with native_cpu_kernels():
                loss.backward()
        else:
            loss.backward()
        return [p.grad for p in params if p.grad is not None]

    def backward(self, loss: torch.Tensor, params: Sequence[torch.Tensor],
                 device: torch.device) -> List[torch.Tensor]:
        """Backward of ``loss`` (fp16: scaled, then unscaled); the gradients of ``params``."""
        grads = self._scaled_backward(loss, params, device)
        if grads and self.scale != 1.0:
            torch._foreach_mul_(grads, 1.0 / self.scale)
        return grads

    def backward_guarded(self, loss: torch.Tensor, params: Sequence[torch.Tensor],
                         device: torch.device, found_inf: torch.Tensor,
                         inv_scale: torch.Tensor) -> List[torch.Tensor]:
        """:meth:`backward` with the finiteness check on the device (no host sync).

        ``found_inf`` (a float32 scalar on the device) is set to 1.0 when the loss or any gradient
        is not finite, else 0.0; the gradients are unscaled by ``inv_scale`` (``1 / scale``, 1.0 in
        fp32/bf16) in the same kernel as the check (GradScaler's
        ``_amp_foreach_non_finite_check_and_unscale_``). Nothing here reads a value on the host,
        so it can be captured in a CUDA graph.
        """
        found_inf.copy_(torch.logical_not(torch.isfinite(loss.detach())))
        grads = self._scaled_backward(loss, params, device)
        if grads:
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
        return grads

    def feature_cache(self, lobe, blocker: Optional[str]) -> "FeatureCache":
        """The per-utterance feature cache of a method; ``blocker`` says why it would not be exact
        (None: it is). ``on`` with a blocker is an error, ``auto`` falls back to full passes."""
        if self.cache_features == "on" and blocker:
            raise ValueError(f"cache_features: on is not exact here: {blocker}")
        return FeatureCache(lobe, enabled=self.cache_features != "off" and not blocker,
                            runtime=self)


class FeatureCache:
    """The CNN features of the current utterance, computed on first use (None when disabled)."""

    def __init__(self, lobe, enabled: bool, runtime: Runtime):
        self.lobe, self.enabled, self.runtime = lobe, bool(enabled), runtime
        self._src = self._feats = None

    def get(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        if not self.enabled:
            return None
        if self._src is not x:
            with torch.no_grad(), self.runtime.autocast(self.lobe.device.type):
                self._feats = self.lobe.features(x)
            self._src = x
        return self._feats

    def clear(self) -> None:
        self._src = self._feats = None


def deterministic_kernels(on: bool) -> None:
    """Process-wide choice of the CUDA kernels (the run option ``deterministic``): ``True`` makes
    cuDNN pick deterministic algorithms (no autotuning) and asks torch for deterministic kernels
    (``warn_only``: CTC loss backward, used by AWMC and SDPL, has none on CUDA); ``False`` is
    PyTorch's default (faster kernels that may order floating-point sums differently from run
    to run). CPU kernels are deterministic either way. cuBLAS needs ``CUBLAS_WORKSPACE_CONFIG``
    set before CUDA starts (``tta_brain.decode`` does it)."""
    torch.backends.cudnn.deterministic = bool(on)
    torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(bool(on), warn_only=True)


#: the run option ``tf32``: what each value lets run in TensorFloat-32 on CUDA (Ampere and later)
TF32_MODES = {"torch": "cuDNN convolutions (PyTorch's defaults; fp32 matmuls)",
              "off": "nothing (fp32 matmuls and convolutions)",
              "on": "matmuls and cuDNN convolutions (SpeechBrain's allow_tf32 quirk)"}


def tf32_kernels(mode: str = "torch") -> str:
    """Process-wide TF32 use on CUDA (the run option ``tf32``); returns the line logged with a run.

    Importing ``speechbrain`` turns TF32 on for matmuls and cuDNN convolutions (its
    ``allow_tf32`` quirk; tta-brain's own modules import it without, :mod:`tta_brain.quirks`), so
    a run's "fp32" matmuls could run in TF32 (10-bit mantissa) while a script that never imports
    speechbrain (the official code, ``tools/bench_speed.py``) ran them in fp32. ``torch`` (the run block's default) restores PyTorch's defaults: fp32
    matmuls, TF32 cuDNN convolutions, as the official code runs; ``off``: no TF32 at all;
    ``on``: SpeechBrain's setting. No effect on CPU."""
    torch.backends.cuda.matmul.allow_tf32 = mode == "on"
    torch.backends.cudnn.allow_tf32 = mode != "off"
    return f"{mode} (TF32: {TF32_MODES[mode]})"


def process_settings(device, deterministic: bool = True, tf32: str = "torch") -> str:
    """The run block's process-wide settings for a run on ``device`` (``tta_brain.decode`` and
    ``TTAStream.from_hparams`` call it before the first pass): on CUDA the cuBLAS workspace
    variable (read when cuBLAS starts) and :func:`deterministic_kernels`; everywhere
    :func:`tf32_kernels` (a process that imported speechbrain itself has its TF32 quirk on;
    :mod:`tta_brain.quirks`). Returns the line logged with the run."""
    if device is not None and str(device).startswith("cuda"):
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        deterministic_kernels(bool(deterministic))
        return (("true" if deterministic else "false (PyTorch's default kernels)")
                + f"; tf32: {tf32_kernels(tf32)}")
    tf32_kernels(tf32)
    return f"{'true' if deterministic else 'false'}; tf32: {tf32} (no effect on {device})"


@contextmanager
def native_cpu_kernels():
    """oneDNN (mkldnn) off inside the block (process-wide flag, restored on exit)."""
    prev = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = False
    try:
        yield
    finally:
        torch.backends.mkldnn.enabled = prev


#: entries kept by oneDNN's primitive cache and by ideep's (PyTorch's oneDNN glue) LRU cache of
#: convolution set-ups, per run (both default to 1024)
KERNEL_CACHE_CAPACITY = 64
KERNEL_CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def bound_kernel_caches(capacity: int = KERNEL_CACHE_CAPACITY) -> dict:
    """Bound the shape-keyed caches of the CPU kernels, unless the user set their variables;
    returns the values in force.

    oneDNN (the CPU convolutions and GELUs) caches one compiled primitive per input shape, and
    ideep one convolution set-up per shape, up to 1024 each. On a real stream every utterance has
    its own length, so the caches fill with shapes that never come back and the RSS of a long run
    creeps up, with or without tta-brain (tools/bench_memory.py and its ``--control`` loop). One
    utterance reuses only its own shapes across its adaptation steps, so 64 entries lose no reuse
    (oneDNN's creation log, SUTA on two 3 s utterances with a wav2vec2-base-sized model: 63 misses
    and 321 hits at 64 entries, the same at 1024).
    Both libraries read their variable when they first build a kernel: call this before the first
    forward (a later call changes nothing).
    """
    return {k: os.environ.setdefault(k, str(int(capacity))) for k in KERNEL_CACHE_VARIABLES}


def _libc_malloc_trim():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


_malloc_trim = _libc_malloc_trim()


def free_run_memory() -> None:
    """After a run in a process that goes on (a grid job's runs one after another, a sweep's
    fallback, a notebook): collect the run's objects now. A method and its step refer to each
    other (``method.step.m``, the hooks' bound methods), so a finished run's model, optimiser
    state and captured graphs stay allocated until the cyclic collector happens to run (on an
    H200 the GPU check's memory section, run after 16 decodes in its process, began at 9.2 GB
    allocated, against 0.6 GB in a fresh process; not rerun there with this collection). On CUDA
    the freed blocks go back to the driver too, for the processes beside this one."""
    import gc
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def release_freed_memory() -> None:
    """Give freed heap pages back to the OS (glibc ``malloc_trim``; a no-op elsewhere).

    Utterances of varying length make the CPU kernels allocate and free buffers of ever new
    sizes; glibc keeps the freed pages, so the RSS of a long stream creeps up although nothing is
    kept (tools/bench_memory.py). Calling this every few utterances keeps it flat.
    """
    if _malloc_trim is not None:
        _malloc_trim(0)
