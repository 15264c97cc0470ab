"""pip's way to c2f's Python module: ``pip install --no-build-isolation ./python`` (offline, with Debian's
setuptools) builds the extension c2f._c2f with the project's own CMake build (Release, the C2F_PYTHON block
of CMakeLists.txt) and installs the package c2f. The CMake way (cmake --build, cmake --install) needs no pip:
docs/python.md says which to run.

Environment: C2F_NATIVE=1 adds -march=native; CMAKE_BUILD_PARALLEL_LEVEL sets the build's jobs (default 2).
"""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


class CMakeBuild(build_ext):
    """Builds c2f._c2f with CMake and copies it where setuptools expects the extension."""

    def build_extension(self, ext):
        build_dir = Path(self.build_temp).resolve() / "cmake"
        configure = ["cmake", "-S", str(REPO), "-B", str(build_dir), "-DCMAKE_BUILD_TYPE=Release",
                     "-DC2F_PYTHON=ON", "-DC2F_BUILD_TESTS=OFF", "-DC2F_BUILD_EXAMPLES=OFF",
                     "-DC2F_BUILD_BENCHMARKS=OFF", "-DC2F_INSTALL=OFF", f"-DPython3_EXECUTABLE={sys.executable}",
                     f"-DC2F_NATIVE={'ON' if os.environ.get('C2F_NATIVE') else 'OFF'}"]
        subprocess.run(configure, check=True)
        jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL", "2")
        subprocess.run(["cmake", "--build", str(build_dir), "--target", "c2f_python", "-j", jobs], check=True)
        built = next((build_dir / "python" / "c2f").glob("_c2f*"))
        target = Path(self.get_ext_fullpath(ext.name))
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(built, target)


# setuptools' build and egg-info folders under the repository's build/ (ignored by git), not in python/.
BUILD = REPO / "build" / "pip"
BUILD.mkdir(parents=True, exist_ok=True)
version = re.search(r"project\(c2f\s+VERSION\s+([0-9.]+)", (REPO / "CMakeLists.txt").read_text()).group(1)
setup(
    name="c2f",
    version=version,
    description="c2f's attention layers (C++, Eigen) from Python, and c2f.torch.accelerate for PyTorch models",
    packages=["c2f"],
    ext_modules=[Extension("c2f._c2f", sources=[])],
    cmdclass={"build_ext": CMakeBuild},
    python_requires=">=3.8",
    install_requires=["numpy"],
    zip_safe=False,
    options={"build": {"build_base": str(BUILD)}, "egg_info": {"egg_base": str(BUILD)}},
)
