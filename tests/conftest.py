"""Test set-up: 8 simulated CPU devices and strict dtype promotion, before JAX starts."""

from __future__ import annotations

import gc
import os
import shutil
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Tests compile hundreds of small programs and run each for a few steps: skip LLVM's costly
# optimisation passes (a third less compile time; the numerics are the same, no fast-math either way),
# and compile with XLA:CPU's legacy loop emitters, not its fusion emitters (a program without a
# pipeline compiles in a half to a third of the time; the suite took 17m34s against 27m19s, one
# after the other on one host). The legacy emitters round some results otherwise (the reference
# compressors' step is then not the Pallas kernels' bit for bit) and run a scatter as a loop: a test
# whose subject is the default code takes the ``fusion_emitters`` fixture. The processes tests start
# inherit the flags. Set TORSH_JAX_TESTS_OPTIMIZED=1 to keep the defaults.
LEGACY_EMITTERS = "--xla_cpu_use_fusion_emitters=false"
if not os.environ.get("TORSH_JAX_TESTS_OPTIMIZED"):
    FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
    if not os.environ.get("TORSH_JAX_TESTS_FUSION_EMITTERS"):
        FAST_COMPILE += f" {LEGACY_EMITTERS}"
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE}".strip()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_dtype_promotion", "strict")
# One compilation cache per test session, shared by its workers and the processes they start (a
# program compiled twice, a step and its inspect report, compiles once), in a new directory each
# session: with jaxlib 0.10.2, a CPU program with collectives loaded from a cache an earlier session
# wrote aborted in XLA's collective rendezvous after another multi-device program had run (the
# interleaved ZeRO-3 pipeline step, on every warm-cache run; see docs/pipeline.md).
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="torsh_jax_tests_")
    os.environ["TORSH_JAX_TESTS_CACHE_OWNER"] = str(os.getpid())
# Every program is cached, however quickly it compiled: the processes the tests start (a job's
# processes, a restarted job, a command) each compile the same small programs again otherwise (the
# multi-process and demo tests took 117.8 s with a 0.5 s floor, 101.3 s without; in-process tests
# alike either way).
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
CACHE_FLOOR_S = float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"])
jax.config.update("jax_persistent_cache_min_compile_time_secs", CACHE_FLOOR_S)
# Start the backend now, with its 8 devices: a command run in-process first (demo --devices 4)
# would otherwise request its own count before the backend starts and shrink the whole worker.
jax.devices()

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
CORPUS = SHARED / "corpus"


#: the fuzzers' example counts scale by this (``TORSH_JAX_FUZZ_SCALE=5`` fuzzes five times deeper;
#: the counts are set for the suite's time on 2 cores)
FUZZ_SCALE = float(os.environ.get("TORSH_JAX_FUZZ_SCALE", "1"))


def fuzz_examples(n: int) -> int:
    """``n`` examples at :data:`FUZZ_SCALE` (at least one)."""
    return max(1, round(n * FUZZ_SCALE))


def imports_jax(code: str) -> bool:
    """Whether Python ``code`` run in a fresh interpreter has imported JAX by its end."""
    import subprocess
    import sys

    probe = f"{code}\nimport sys\nprint('jax' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return done.stdout.splitlines()[-1] == "True"


def require_devices(n: int) -> list:
    """The first ``n`` devices, or skip the test when fewer exist."""
    devices = jax.devices()
    if len(devices) < n:
        pytest.skip(f"needs {n} devices, have {len(devices)}")
    return devices[:n]


#: test functions run with the fusion emitters in a process of their own: what failed, or ``""``
_RAN_WITH_FUSION_EMITTERS: dict[str, str] = {}


@pytest.fixture
def fusion_emitters(request) -> bool:
    """Run the test with XLA:CPU's fusion emitters, its default code, where this process compiles
    with the legacy ones (:data:`LEGACY_EMITTERS`): in a pytest process of its own, which must
    pass, with every parametrization of the test function (one process for them all). ``True``
    when it ran there (the test then returns), ``False`` when this process compiles with them
    already (the test runs here)."""
    import subprocess
    import sys

    flags = os.environ.get("XLA_FLAGS", "").split()
    if LEGACY_EMITTERS not in flags:
        return False
    function = request.node.nodeid.split("[")[0]
    if function not in _RAN_WITH_FUSION_EMITTERS:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST_")}
        env["TORSH_JAX_TESTS_FUSION_EMITTERS"] = "1"
        env["XLA_FLAGS"] = " ".join(f for f in flags if f != LEGACY_EMITTERS)
        cli = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--durations=0", function]
        done = subprocess.run(cli, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
        _RAN_WITH_FUSION_EMITTERS[function] = (
            done.stdout[-4000:] + done.stderr[-2000:] if done.returncode else ""
        )
    failed = _RAN_WITH_FUSION_EMITTERS[function]
    assert not failed, failed
    return True


@pytest.fixture
def default_gpu_memory(monkeypatch) -> None:
    """No setting of the share of a GPU's memory JAX's allocator takes: its default, 75 %."""
    from torsh_jax.targets.catalog import JAX_GPU_MEMORY_VARIABLES

    for variable in JAX_GPU_MEMORY_VARIABLES:
        monkeypatch.delenv(variable, raising=False)


@pytest.fixture
def corpus_dir() -> Path:
    """``../shared/corpus``; skips when it is not beside the checkout."""
    if not CORPUS.is_dir():
        pytest.skip(f"corpus not found at {CORPUS}")
    return CORPUS


def pytest_sessionfinish(session) -> None:
    """End a pytest-xdist worker within the 5 s its controller gives it once it reports finishing
    (execnet then interrupts it: a ``KeyboardInterrupt`` printed after the last test). pytest's own
    end-of-session cleanup collects garbage five times; over a worker's heap of JAX programs each
    collection took 1.0-1.3 s (0.8-0.9 M objects after four test files). Collected once here, before
    the worker reports (xdist reports after every ``pytest_sessionfinish``), the survivors are then
    frozen out of those five."""
    gc.collect()
    gc.freeze()


def pytest_unconfigure(config) -> None:
    """The session that made the compilation cache removes it."""
    if os.environ.get("TORSH_JAX_TESTS_CACHE_OWNER") == str(os.getpid()):
        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
