"""Data preparation for tta-brain: audio I/O, SNR mixing, CSV manifests, test streams and corpus
preparation (LibriSpeech, MS-SNSD corruption, CHiME-3). Submodules are imported on demand so that
light-weight steps (manifests, streams) do not pay for importing torch."""
