"""The CUDA path of the adaptation steps: device-side guard, captured graphs."""
