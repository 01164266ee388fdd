"""tta-brain: continual test-time adaptation of CTC speech recognisers on noisy speech."""
__version__ = "0.1.0"
