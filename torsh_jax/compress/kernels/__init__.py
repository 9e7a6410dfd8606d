"""Pallas kernels of the compressors (TPU via Mosaic, GPU via Triton, or interpreted).

Only :mod:`torsh_jax.compress.kernels.blockwise` exists: int8, int4 and sign
encode, decode and the fused error-feedback step. Top-k, PowerSGD and the
casts use their ``jnp`` references on every backend.
"""
