"""Print how far one LSQML chunk step on CuPy is from the NumPy one (norm-relative, per part).

A diagnostic for tests/test_gpu.py::test_cupy_chunk_step_matches_numpy, run by gpu_check.sh.
"""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))


def main():
    import cupy

    from synthetic import make_dataset

    from daskpty.engines import lsqml

    ds = make_dataset(grid=6)
    y = np.fft.ifftshift(ds.intensities, axes=(-2, -1))
    for update_probe in (True, False):
        opts = lsqml.LSQMLOptions()
        obj = np.ones_like(ds.truth.object)
        cpu = lsqml.chunk_step(obj, ds.truth.probe, y, ds.positions, options=opts, update_probe=update_probe)
        gpu = lsqml.chunk_step(obj, ds.truth.probe, cupy.asarray(y), ds.positions, options=opts, update_probe=update_probe)
        for key, box in cpu.boxes.items():
            ref = box.data
            diff = np.linalg.norm(np.asarray(gpu.boxes[key].data) - ref) / np.linalg.norm(ref)
            print(f"update_probe={update_probe} box {key}: norm-relative difference {diff:.3e}")
        for key, ref in cpu.arrays.items():
            ref = np.asarray(ref)
            diff = np.linalg.norm(np.asarray(gpu.arrays[key]) - ref) / max(np.linalg.norm(ref), 1e-30)
            print(f"update_probe={update_probe} array {key}: norm-relative difference {diff:.3e}")
        for key, value in cpu.scalars.items():
            print(f"update_probe={update_probe} scalar {key}: cpu {value:.9g} gpu {gpu.scalars[key]:.9g}")


if __name__ == "__main__":
    main()
