import os
import random

import pytest

# Under pytest-xdist (make test) each core runs a worker, and each worker's torch and numba keep
# OpenMP threads; spinning ones would take the other worker's core (set before torch loads OpenMP).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# Small calls run on one thread (memory.serial_max_bytes); the tests' tensors are small, and the
# chunked paths (several threads, the weight gradients' per-chunk rows) must stay under test.
# tests/test_cpu_memory.py checks the one-thread rule itself.
os.environ.setdefault("NORMLAB_CPU_SERIAL_MB", "0")

import torch  # noqa: E402

# Tests pick their backends explicitly; a NORMLAB_BACKEND left in the shell must not change them.
os.environ.pop("NORMLAB_BACKEND", None)
# Kernels compiled ahead of time (tools/build_tiers.py) would be loaded where the tests count what
# compiles; a checkout that built them keeps them for its users, not for the tests (test_cpu_tiers).
os.environ["NORMLAB_CPU_TIERS"] = "off"
# Without a GPU the Triton kernels run under Triton's interpreter, on CPU tensors. Triton reads the
# flag when a kernel is defined, so it is set before anything imports normlab.kernels.triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def gen() -> torch.Generator:
    """A generator with a fresh seed each run, so inputs are new every time. A failing test
    reports its seed; NORMLAB_TEST_SEED=<seed> reruns with the same inputs."""
    seed = int(os.environ.get("NORMLAB_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))
    g = torch.Generator().manual_seed(seed)
    return g


# `make test` (--dist loadgroup) hands each group of tests to one worker. A file is a group of its
# own, so its module fixtures are built once; the files that compile the kernels in this process
# share the group "kernels": on one worker a signature is compiled once and then loaded, where
# two workers would compile it twice at once. The longest files come first (their
# pytest.mark.slow(minutes=...); --no-loadscope-reorder keeps this order), so short files fill the
# end of the run where a long one would leave a core idle.
@pytest.hookimpl(tryfirst=True)  # xdist reads the groups in its own hook
def pytest_collection_modifyitems(config, items):
    def minutes(item):
        mark = item.getparent(pytest.Module).get_closest_marker("slow")
        return -mark.kwargs.get("minutes", 1) if mark else 0

    items.sort(key=minutes)  # stable: each file keeps its own order
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.path.name))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    g = getattr(item, "funcargs", {}).get("gen")
    if report.failed and g is not None:
        report.sections.append(("random inputs", f"rerun with NORMLAB_TEST_SEED={g.initial_seed()}"))


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """A small corpus of six 'plays' (documents) of random words, for training and lab tests."""
    folder = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    words = "the king queen love death night day sword crown heart blood fair sweet lord lady".split()
    for i in range(6):
        lines = [" ".join(rng.choice(words) for _ in range(10)) for _ in range(300)]
        (folder / f"play{i}.txt").write_text("\n".join(lines))
    return folder
