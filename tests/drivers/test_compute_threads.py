"""An in-process device computes what a device process computes: numpy's BLAS at the device's --threads."""
import subprocess
import sys

import numpy as np
from threadpoolctl import threadpool_info

from device_runtime.frobenius import frobenius_decay_step
from server.compute_threads import device_blas_threads
from tests.support.processes import child_env

STEP = """
import sys, numpy as np
from device_runtime.frobenius import frobenius_decay_step
u, v = (np.random.default_rng(0).standard_normal(s).astype(np.float32) for s in ((1600, 256), (1024, 256)))
np.save(sys.argv[1], np.concatenate([x.ravel() for x in frobenius_decay_step(u, v, 1e-3, 0.5)]))
"""


def blas_threads() -> set[int]:
    return {pool["num_threads"] for pool in threadpool_info() if pool["user_api"] == "blas"}


def test_device_blas_threads_pins_numpy_blas_inside_and_restores_it_after():
    before = blas_threads()
    with device_blas_threads(1):
        assert blas_threads() == {1}
    assert blas_threads() == before


def test_a_frobenius_step_under_device_threads_is_the_device_processs_bit_for_bit(tmp_path):
    """A device process pins OPENBLAS_NUM_THREADS to its --threads before numpy loads (device_runtime.__main__);
    on CPUs where sgemm's last bits depend on the thread count, only the same pin in this process gives its bits."""
    out = tmp_path / "device.npy"
    subprocess.run([sys.executable, "-c", STEP, str(out)], check=True, timeout=120,
                   env=child_env(OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", repo_on_path=True))
    u, v = (np.random.default_rng(0).standard_normal(s).astype(np.float32) for s in ((1600, 256), (1024, 256)))
    with device_blas_threads(1):
        here = np.concatenate([x.ravel() for x in frobenius_decay_step(u, v, 1e-3, 0.5)])
    np.testing.assert_array_equal(here, np.load(out))
