"""runtime/artifact/tvm_runtime.py apply_cpu_threads: the thread count TVM's pool gets, and its
thread binding left to the OS unless the user asks TVM to pin (pinned pools intermittently
ran whole processes at half speed on a 2-core machine: tests/bench/thread_binding.py)."""
from __future__ import annotations

import pytest

from vtool.runtime.artifact.tvm_runtime import BIND_THREADS_ENV, CPU_THREADS_ENV, RuntimeLoadError, apply_cpu_threads


@pytest.fixture
def clean_env(monkeypatch):
    for name in (CPU_THREADS_ENV, "TVM_NUM_THREADS", "OMP_NUM_THREADS", BIND_THREADS_ENV):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_threads_and_unpinned_pool(clean_env):
    import os

    assert apply_cpu_threads(3) == 3
    assert os.environ["TVM_NUM_THREADS"] == os.environ[CPU_THREADS_ENV] == "3"
    assert os.environ[BIND_THREADS_ENV] == "0"


def test_a_users_binding_is_kept(clean_env):
    import os

    clean_env.setenv(BIND_THREADS_ENV, "1")
    apply_cpu_threads(2)
    assert os.environ[BIND_THREADS_ENV] == "1"


@pytest.mark.parametrize("bad", ["0", "-2", "two"])
def test_bad_counts_are_refused_by_name(clean_env, bad):
    with pytest.raises(RuntimeLoadError, match=CPU_THREADS_ENV):
        apply_cpu_threads(bad)
