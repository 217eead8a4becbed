"""Torch kernels shared by policies: dense reference attention, sampling, certificates, sketches.

Same code on CPU and CUDA; vectorised over heads and query rows; no per-token Python loops.
"""
