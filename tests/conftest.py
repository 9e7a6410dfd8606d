"""Test set-up: 8 simulated CPU devices and strict dtype promotion, before JAX starts."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_dtype_promotion", "strict")
# One compilation cache for the session's workers and the processes they start: a program compiled
# twice (a step and its inspect report, the same twin in two tests) compiles once.
CACHE = os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR", str(Path(tempfile.gettempdir()) / f"torsh_jax_tests_{jax.__version__}")
)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
jax.config.update("jax_compilation_cache_dir", CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
# Start the backend now, with its 8 devices: a command run in-process first (demo --devices 4)
# would otherwise request its own count before the backend starts and shrink the whole worker.
jax.devices()

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
CORPUS = SHARED / "corpus"


def require_devices(n: int) -> list:
    """The first ``n`` devices, or skip the test when fewer exist."""
    devices = jax.devices()
    if len(devices) < n:
        pytest.skip(f"needs {n} devices, have {len(devices)}")
    return devices[:n]


@pytest.fixture
def corpus_dir() -> Path:
    """``../shared/corpus``; skips when it is not beside the checkout."""
    if not CORPUS.is_dir():
        pytest.skip(f"corpus not found at {CORPUS}")
    return CORPUS
