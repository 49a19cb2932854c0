"""Triton kernels for the GPU path; import only where triton is installed.

Specialisation rule: Triton compiles one variant per combination of constexprs and of each
integer argument's "is 1 / divisible by 16" and each pointer's 16-byte alignment. Arguments
that change from step to step (block-table row strides, row counts, slices of the step's packed
inputs) are marked ``do_not_specialize``, so eager steps of any batch composition reuse the
variants compiled by the start-up profile run and CUDA-graph capture instead of stalling on a
compile mid-run.
"""
