"""The adaptation step of a method, chosen once when the method is built (:func:`make_step`):

* :class:`~tta_brain.gpu.host_step.HostStep`: the eager step with the finiteness check read on
  the host (CPU, and the methods or settings the device step does not cover);
* :class:`~tta_brain.gpu.device_step.DeviceStep` (CUDA): the guard on the device, no host sync
  inside a step (``guard``), eager or replayed from captured CUDA graphs (``graphs``).

A method declares what the device step needs to know (class attributes, read here): ``device_loss``
(True: its loss and steps run on the device alone; None, the default: only if it keeps the
skeleton's ``loss``, ``before_step`` and ``forward_and_adapt``, i.e. the SUTA family; False: never;
DSUTA, Tent, EATA, SAR and CEA declare True; EATA's sample filter is a ``guard.StepFilter``,
decided on the device; SAR brings its whole SAM step as a ``device_body``)
and ``device_optimizers`` (names of optimisers besides ``optimizer`` that the device step runs
fused too; DSUTA: ``slow_optimizer``; CEA: ``optimizer2``, whose steps are device steps too).

Runtime options (``tta_brain.lobes.runtime.Runtime``): ``cuda_graphs: auto`` (default) captures
the steps on CUDA wherever that is exact (fp32, no ``compile``, no train mode, a method whose steps
run on the device alone) and keeps the host step elsewhere; ``on`` says why where it cannot;
``off`` never captures. ``cuda_graph_buckets: auto`` (default; ratio 0.1 on CUDA) or ``r`` (> 0)
runs the captured steps on length buckets where the padded pass is exact (:func:`bucket_blocker`),
so one graph serves a bucket of lengths; ``0`` turns them off.
``cuda_device_steps: true`` takes the device step without capture wherever
it applies (``cuda_graphs: on`` or ``auto`` captured where they can).
"""
import inspect
import logging
from typing import Optional

from tta_brain.gpu.device_step import DeviceStep
from tta_brain.gpu.graphs import CudaGraphBackend
from tta_brain.gpu.guard import device_optimizer_blocker
from tta_brain.gpu.host_step import HostStep, train_draws

logger = logging.getLogger(__name__)

__all__ = ["make_step", "step_blocker", "bucket_blocker", "train_draws", "HostStep", "DeviceStep"]

#: what a method overrides when its steps do host work (beam search, pseudo labels, lr schedule)
_STEP_HOOKS = ("loss", "before_step", "forward_and_adapt")


def _defined_by(cls, name):
    return next(c for c in cls.__mro__ if name in vars(c))


def step_blocker(m) -> Optional[str]:
    """Why method ``m``'s steps cannot take the device step (None: they can)."""
    if not m.params:
        return "nothing adapts"
    declared = getattr(m, "device_loss", None)
    if declared is False:
        return "its loss needs host work"
    skeleton = _defined_by(type(m), "adapt_step")
    if declared is None and any(_defined_by(type(m), h) is not skeleton for h in _STEP_HOOKS):
        return ("its loss or its steps need host work (only the SUTA family's, Tent's, EATA's, "
                "SAR's and CEA's run on the device)")
    return device_optimizer_blocker(m.optimizer)


def bucket_blocker(m) -> Optional[str]:
    """Why method ``m``'s steps cannot run on length buckets (None: they can): the padded pass
    must be exact for the model (``lobe.padding_blocker``) and the loss must mask the padded
    frames (it takes their number: ``loss(logits, lengths)``, as the SUTA loss and Tent's)."""
    if "lengths" not in inspect.signature(type(m).loss).parameters:
        return "its loss does not mask padded frames (it takes no lengths)"
    return m.lobe.padding_blocker()


def _no_graph(m, rt, device, backend) -> Optional[str]:
    """Why the steps of ``m`` are not captured (None: they are). A ``train_mode`` whose model
    draws nothing (no dropout, LayerDrop, SpecAugment or batch norm) is captured: its passes are
    the eval-mode passes."""
    draws = train_draws(m)
    return ("cuda_graphs is off" if rt.cuda_graphs == "off" else
            f"precision {rt.precision} (fp32 only)" if rt.dtype is not None else
            "compile is on" if rt.compile else
            f"train_mode (this model draws in train mode: {', '.join(draws)})" if draws else
            "not on CUDA" if device.type != "cuda" and backend is None else None)


def make_step(m, backend=None, device_on_cpu: bool = False):
    """The step of method ``m`` from its lobe's runtime options, its device and what it declares.

    Test doubles: ``backend`` replaces the CUDA graph backend (a fake that records and replays
    the step), ``device_on_cpu`` takes the device step on CPU tensors (the path is
    device-agnostic). Pass them with ``functools.partial(make_step, ...)`` as the method's
    ``make_step`` argument.
    """
    rt = m.runtime
    device = m.params[0].device if m.params else m.lobe.device
    asked = rt.cuda_graphs == "on" or rt.cuda_device_steps      # asked for, not the default
    if device.type != "cuda" and not device_on_cpu:
        tuned = [k for k, default in (("cuda_graph_cache", "auto"), ("cuda_graph_warmup", 1),
                                      ("cuda_graph_buckets", "auto")) if getattr(rt, k) != default]
        if asked or tuned:      # (the graphs' settings too: given, read by nothing here)
            logger.info("%s: %s: no effect on %s", m.name, " / ".join(
                (["cuda_device_steps", "cuda_graphs"] if asked else []) + tuned), device)
        return HostStep(m)
    why = step_blocker(m)
    if why:
        (logger.warning if asked else logger.info)(
            "%s: no device step (%s); the steps keep the host check on %s", m.name, why, device)
        return HostStep(m)
    no_graph = _no_graph(m, rt, device, backend)
    if no_graph and not asked:              # auto: captured where exact, the host step elsewhere
        logger.info("%s: steps not captured (%s); the host step on %s", m.name, no_graph, device)
        return HostStep(m)
    if no_graph and rt.cuda_graphs == "on":
        logger.warning("%s: no CUDA graphs (%s); the steps run eagerly with the device-side "
                       "check", m.name, no_graph)
    if no_graph is None and backend is None:
        backend = CudaGraphBackend(device)
    buckets = rt.bucket_ratio(device.type) if no_graph is None else 0.0
    if buckets and (why := bucket_blocker(m)):
        # auto: buckets where exact, said once; asked for (a ratio): a warning
        (logger.info if rt.cuda_graph_buckets == "auto" else logger.warning)(
            "%s: no length buckets (%s); every new length is captured", m.name, why)
        buckets = 0.0
    cache = rt.graph_cache(buckets)
    if buckets and cache < 4:
        logger.warning("%s: length buckets with cuda_graph_cache %d keep the graphs of %s bucket: "
                       "a stream that moves between buckets captures again and again (set "
                       "cuda_graph_cache to about the number of buckets it visits, or auto)",
                       m.name, cache, "one" if cache == 1 else "few")
    logger.info("%s: adaptation steps on %s with the device-side check and %s%s",
                m.name, device, ("RepeatedAdam on the device" if hasattr(m.optimizer, "on_device")
                                 else f"fused {type(m.optimizer).__name__}"),
                (", captured as CUDA graphs" if no_graph is None else "")
                + (f" on length buckets (ratio {buckets:g})" if buckets else ""))
    return DeviceStep(m, backend if no_graph is None else None, cache,
                      rt.cuda_graph_warmup, getattr(m, "device_optimizers", ()), buckets)
