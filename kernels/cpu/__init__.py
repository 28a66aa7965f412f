"""cadenza's CPU kernels: the C++ sources (`*.cpp`, `*.h`), `loader.py`, which builds the variant
this CPU runs (AVX2, AVX-VNNI or AVX-512 VNNI) on first use and caches it, and `features.py`, the
one place cadenza reads the CPU's features (and `CADENZA_CPU`, which makes one machine act as
another kind).
"""
