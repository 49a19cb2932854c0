"""Triton kernels for the GPU path; import only where triton is installed."""
