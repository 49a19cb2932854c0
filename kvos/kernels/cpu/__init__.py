"""C kernels for the CPU path (AVX2 + FMA), built with the system's C compiler on first use and
called through ctypes; without a compiler or those instructions the CPU path stays on torch."""
