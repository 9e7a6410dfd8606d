"""Translate foreign configs into plans (no JAX import)."""
