"""Offline text-to-speech with espeak-ng, driven through ``ctypes``.

The shared library and its data come from the PyPI wheel ``espeakng-loader``
(``pip install espeakng-loader``), so no system package is needed.

espeak-ng keeps global state and is not thread-safe: create one :class:`EspeakTTS`
per process (use ``multiprocessing`` to render in parallel).

Example::

    tts = EspeakTTS()
    wav = tts.synthesize("hello world", voice="en-us+m3", rate=170, pitch=50, pitch_range=50)
    # float32 numpy array, 16 kHz, mono, in [-1, 1]
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
from typing import List, Optional

import numpy as np

__all__ = ["EspeakTTS", "EspeakError", "OUTPUT_SAMPLE_RATE"]

OUTPUT_SAMPLE_RATE = 16000

# espeak_AUDIO_OUTPUT
_AUDIO_OUTPUT_SYNCHRONOUS = 2
# espeak_PARAMETER
_RATE, _VOLUME, _PITCH, _RANGE = 1, 2, 3, 4
# espeak_POSITION_TYPE / flags
_POS_CHARACTER = 1
_CHARS_UTF8 = 1

# int SynthCallback(short *wav, int numsamples, espeak_EVENT *events)
_SYNTH_CALLBACK = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.c_void_p
)

_ENGINE_PID: Optional[int] = None  # the process whose espeak instance is initialised


class EspeakError(RuntimeError):
    """espeak-ng could not be loaded or failed to synthesise."""


def _locate():
    try:
        import espeakng_loader
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise EspeakError(
            "espeak-ng is provided by the PyPI wheel 'espeakng-loader'; "
            "install it with `pip install espeakng-loader`"
        ) from exc
    lib, data = espeakng_loader.get_library_path(), espeakng_loader.get_data_path()
    if not os.path.isfile(lib):
        raise EspeakError(f"espeak-ng shared library not found at {lib}")
    if not os.path.isdir(data):
        raise EspeakError(f"espeak-ng data directory not found at {data}")
    return lib, data


class EspeakTTS:
    """One espeak-ng engine (one per process) rendering text to 16 kHz float32 audio.

    Arguments
    ---------
    output_sample_rate : int
        Sample rate of the returned audio (espeak renders at 22,050 Hz).
    """

    def __init__(self, output_sample_rate: int = OUTPUT_SAMPLE_RATE):
        global _ENGINE_PID
        lib_path, data_path = _locate()
        try:
            self._lib = ctypes.CDLL(lib_path)
        except OSError as exc:
            raise EspeakError(f"cannot load espeak-ng library {lib_path}: {exc}") from exc
        lib = self._lib
        lib.espeak_Initialize.restype = ctypes.c_int
        lib.espeak_Initialize.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
        lib.espeak_SetSynthCallback.argtypes = [_SYNTH_CALLBACK]
        lib.espeak_SetVoiceByName.argtypes = [ctypes.c_char_p]
        lib.espeak_SetVoiceByName.restype = ctypes.c_int
        lib.espeak_SetParameter.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
        lib.espeak_SetParameter.restype = ctypes.c_int
        lib.espeak_Synth.argtypes = [
            ctypes.c_char_p, ctypes.c_size_t, ctypes.c_uint, ctypes.c_int, ctypes.c_uint,
            ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p,
        ]
        lib.espeak_Synth.restype = ctypes.c_int
        lib.espeak_Synchronize.restype = ctypes.c_int
        # espeak-ng draws random numbers (pitch flutter, noise sources, timing), from its own
        # generator and from libc rand(): both are reseeded before each utterance.
        self._set_seed = getattr(lib, "espeak_ng_SetRandSeed", None)
        if self._set_seed is not None:
            self._set_seed.argtypes = [ctypes.c_long]
        self._libc = ctypes.CDLL(None)

        self.native_sample_rate = lib.espeak_Initialize(
            _AUDIO_OUTPUT_SYNCHRONOUS, 0, data_path.encode(), 0
        )
        if self.native_sample_rate <= 0:
            raise EspeakError(f"espeak_Initialize failed (data path {data_path})")
        _ENGINE_PID = os.getpid()
        self.output_sample_rate = output_sample_rate
        self._chunks: List[np.ndarray] = []

        def _collect(wav, n, _events):
            if n > 0 and wav:
                self._chunks.append(np.ctypeslib.as_array(wav, shape=(n,)).copy())
            return 0  # continue synthesis

        self._callback = _SYNTH_CALLBACK(_collect)  # keep a reference: ctypes does not
        lib.espeak_SetSynthCallback(self._callback)

    def synthesize(
        self,
        text: str,
        voice: str = "en-us",
        rate: int = 170,
        pitch: int = 50,
        pitch_range: int = 50,
        seed: int = 0,
    ) -> np.ndarray:
        """Render ``text`` and return float32 mono audio at ``output_sample_rate``.

        Arguments
        ---------
        voice : espeak voice name, optionally with a variant (``en-us+m3``, ``en-gb-scotland+f2``).
        rate : speaking rate in words per minute (espeak accepts 80-450).
        pitch : base pitch 0-100.
        pitch_range : pitch range (intonation) 0-100; 0 is monotone.
        seed : seed of espeak-ng's random generators; the same arguments give the same audio.
        """
        lib = self._lib
        if lib.espeak_SetVoiceByName(voice.encode()) != 0:
            raise EspeakError(f"unknown espeak-ng voice {voice!r}")
        for param, value in ((_RATE, rate), (_PITCH, pitch), (_RANGE, pitch_range), (_VOLUME, 100)):
            if lib.espeak_SetParameter(param, int(value), 0) != 0:
                raise EspeakError(f"espeak_SetParameter({param}, {value}) failed")
        if self._set_seed is not None:
            self._set_seed(int(seed))
        self._libc.srand(ctypes.c_uint(int(seed) & 0xFFFFFFFF))
        data = text.encode("utf-8") + b"\0"
        self._chunks = []
        err = lib.espeak_Synth(data, len(data), 0, _POS_CHARACTER, 0, _CHARS_UTF8, None, None)
        if err != 0:
            raise EspeakError(f"espeak_Synth failed with code {err} for text {text!r}")
        lib.espeak_Synchronize()
        pcm = np.concatenate(self._chunks) if self._chunks else np.zeros(0, np.int16)
        self._chunks = []
        audio = pcm.astype(np.float32) / 32768.0
        if self.native_sample_rate != self.output_sample_rate and audio.size:
            import torch
            import torchaudio.functional as AF

            audio = AF.resample(
                torch.from_numpy(audio), self.native_sample_rate, self.output_sample_rate
            ).numpy()
        return audio.astype(np.float32)


def in_fresh_processes(fn, tasks: list) -> list:
    """Run ``fn`` on each task, each in a newly spawned process.

    espeak-ng keeps state from one utterance to the next (the output changes by a few samples),
    so audio is only reproducible when every process renders the same sequence of utterances
    from a fresh start: one spawned process per task, never a worker reused across tasks.
    """
    ctx = mp.get_context("spawn")
    with ctx.Pool(len(tasks), maxtasksperchild=1) as pool:
        return pool.map(fn, tasks, chunksize=1)
