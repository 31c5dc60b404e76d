"""The native kernels' own barrier (genfn/kernels/team_barrier.h): it polls as long as libgomp would,
read from the same settings, and its sleeping path gives the same bits as its spinning one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from genfn import kernels
from test_paged_native import needs_kernel

UNBOUNDED = 2**63 - 1


@needs_kernel
@pytest.mark.parametrize("policy, count, expected", [
    (None, None, [300000, 100]),             # libgomp's defaults; its throttled count for an oversubscribed team
    ("PASSIVE", None, [0, 0]),               # sleeps at once
    ("passive", "1000", [1000, 0]),          # GOMP_SPINCOUNT wins over the policy, as in libgomp
    ("ACTIVE", None, [UNBOUNDED, 1000]),
    (None, "1000", [1000, 100]),             # genfn's quiet-machine choice (genfn/wait_policy.py)
    (None, "10k", [10000, 100]),
    (None, "3M", [3000000, 100]),
    (None, "infinite", [UNBOUNDED, 100]),
    (None, "0", [0, 0]),
    ("ACTIVE", "50", [50, 50]),              # the throttled count never above the chosen one
    (None, "99999999999999T", [UNBOUNDED, 100]),  # past int64: without end
    ("sometimes", "lots", [300000, 100]),    # what libgomp does not read, it leaves at its default
])
def test_the_barrier_spins_as_long_as_libgomp_would(policy, count, expected):
    assert kernels.decode_linear_available()
    assert list(torch.ops.genfn_kernels.barrier_spin_limits(policy, count)) == expected


@needs_kernel
@pytest.mark.parametrize("policy, threads", [({"OMP_WAIT_POLICY": "PASSIVE"}, 2), ({"GOMP_SPINCOUNT": "1"}, 2),
                                             ({}, 2 * (os.cpu_count() or 1))])
def test_a_stack_whose_threads_sleep_at_every_barrier_gives_the_same_bits(policy, threads):
    """With no spin every thread that waits sleeps on the generation (the futex path) and is woken by
    the last to arrive; a team of more threads than CPUs polls only the throttled count and sleeps
    while the others are descheduled: the stack tests pass unchanged and nothing hangs."""
    tests = Path(__file__).parent
    env = {**os.environ, **policy, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": os.pathsep.join(
        [str(tests.parent), str(tests), os.environ.get("PYTHONPATH", "")])}
    env.pop("GENFN_WAIT_POLICY", None)
    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        if name not in policy:
            env.pop(name, None)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
         str(tests / "test_decode_stack.py"), "-k", "gives_the_layer_ops_bits or paged"],
        env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert " passed" in done.stdout and " failed" not in done.stdout


@needs_kernel
def test_the_meeting_time_is_measured_for_the_intra_op_team_and_checks_its_argument():
    """benchmarks record how long the threads take to meet (whether they sat on one die or on two);
    the op runs the barrier with torch's intra-op threads and refuses a count that measures nothing."""
    from genfn.bench.decode import thread_meeting_ns

    before = torch.get_num_threads()
    try:
        for threads in {1, before}:
            torch.set_num_threads(threads)
            ns = thread_meeting_ns(meetings=200)
            assert ns is not None and 0.0 < ns < 1e7
    finally:
        torch.set_num_threads(before)
    with pytest.raises(RuntimeError, match="meetings must be at least 1, got 0"):
        torch.ops.genfn_kernels.barrier_meeting_ns(0)
