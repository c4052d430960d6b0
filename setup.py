"""pip install .: the extension qkv._core is built by CMake (the project's own build), the
package's Python files come from python/qkv. Works offline with --no-build-isolation (needs
cmake, a C++20 compiler, and the library's and the Python module's Debian packages:
scripts/install-deps.sh python).

CMake is configured for the interpreter running pip (-DPython3_EXECUTABLE), with tests and tools
off and libqkv static, so the one extension file is all that installs. QKV_CMAKE_ARGS (in the
environment) adds CMake arguments; CMAKE_BUILD_PARALLEL_LEVEL sets the build's jobs.
"""
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


def require_build_dependencies():
    """Fails at once, naming the interpreter, when it cannot build the module: without numpy,
    wheel or CMake the build would otherwise stop minutes later with an unrelated message (pip's
    `invalid command 'bdist_wheel'`, or CMake's Python module off)."""
    missing = []
    for module, debian in (("numpy", "python3-numpy"), ("wheel", "python3-wheel")):
        try:
            __import__(module)
        except ImportError:
            missing.append(f"{module} (Debian: {debian})")
    if shutil.which("cmake") is None:
        missing.append("cmake (Debian: cmake)")
    if missing:
        sys.exit(
            f"qkv: {sys.executable} cannot build the Python module: it lacks {', '.join(missing)}. "
            "Use Debian's /usr/bin/python3 (scripts/install-deps.sh python installs what it needs), "
            "or a virtualenv made from it with --system-site-packages.")


require_build_dependencies()


class CMakeExtension(Extension):
    """An extension whose sources CMake knows: setuptools compiles nothing itself."""

    def __init__(self, name):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    """Configures and builds the qkv_python_core target, then copies the module where setuptools
    expects the extension."""

    def build_extension(self, ext):
        build_dir = Path(self.build_temp).resolve() / "cmake"
        build_dir.mkdir(parents=True, exist_ok=True)
        configure = [
            "cmake", "-S", str(ROOT), "-B", str(build_dir),
            "-DCMAKE_BUILD_TYPE=Release",
            f"-DPython3_EXECUTABLE={sys.executable}",
            "-DQKV_BUILD_TESTS=OFF", "-DQKV_BUILD_TOOLS=OFF", "-DQKV_BUILD_PYTHON=ON", "-DQKV_SHARED=OFF",
        ] + shlex.split(os.environ.get("QKV_CMAKE_ARGS", ""))
        # Progress lines (pip shows them with -v): the build takes minutes on two cores.
        print(f"qkv: configuring CMake in {build_dir} for {sys.executable}", flush=True)
        subprocess.run(configure, check=True)
        jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 1))
        print(f"qkv: building the module with {jobs} jobs", flush=True)
        subprocess.run(["cmake", "--build", str(build_dir), "--target", "qkv_python_core", "-j", jobs], check=True)
        built = sorted((build_dir / "python" / "qkv").glob("_core*.so"))
        if not built:
            raise RuntimeError(f"CMake built no qkv/_core*.so under {build_dir / 'python' / 'qkv'}")
        target = Path(self.get_ext_fullpath(ext.name))
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(built[0], target)


setup(ext_modules=[CMakeExtension("qkv._core")], cmdclass={"build_ext": CMakeBuild})
