"""The fake GPU's CUDA shim (``shim.cpp``): built once per torch install with the C++ compiler,
cached, and loaded before torch is imported.

torch's CPU build has no CUDA device guard and caches its CUDA hooks at their first use, so the
shim must be in the process before ``import torch``. A CUDA build's own guard and hooks ask the driver:
on a machine without one (a CPU runner that installed torch's default wheel) the shim replaces them too.
It links against the torch it is built for, found without importing it; the cache key is the source,
torch's version and its install path.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.machinery
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

# pytest leaves this module's frames out of a failing test's traceback, as it leaves out its own
# (`--fulltrace` shows them): an error it raises is shown at the user's call.
__tracebackhide__ = True

SOURCE = Path(__file__).with_name("shim.cpp")
BUILD_TIMEOUT_S = 300.0


class ShimError(RuntimeError):
    """The shim cannot be built or loaded; the message says what to install or set."""


def torch_dir() -> Path:
    """torch's package folder, without importing it (and past the import watchers of
    ``rankside.imports``, which a find_spec through ``sys.meta_path`` would set off)."""
    spec = importlib.machinery.PathFinder.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        raise ShimError("the fake GPU runs torch jobs, but torch is not installed in this rank's Python "
                        "(pip install torch: the CPU build is enough)")
    return Path(list(spec.submodule_search_locations)[0])


def torch_build(folder: Path) -> tuple[str, str | None]:
    """(torch's version, the CUDA version it was built for or None), read from ``torch/version.py``."""
    text = (folder / "version.py").read_text()
    version = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)['\"]", text, re.M)
    cuda = re.search(r"^cuda\s*(?::\s*[^=]+)?=\s*['\"]([^'\"]+)['\"]", text, re.M)
    return (version.group(1) if version else "unknown"), (cuda.group(1) if cuda else None)


def needed(folder: Path) -> bool:
    """torch's CPU build needs the shim; a CUDA build only where no CUDA driver is (its own guard and
    hooks would ask for one)."""
    return torch_build(folder)[1] is None or not driver_present()


def driver_present() -> bool:
    """A CUDA driver and a GPU node: ``libcuda.so.1`` loads and ``/dev/nvidiactl`` exists. Nothing is
    initialised (a process that forks ranks must not start CUDA)."""
    if not Path("/dev/nvidiactl").exists():
        return False
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(os.environ.get("GPUMEM_FAKE_GPU_CACHE") or Path(base) / "pytest-gpumem" / "fake-gpu")


def _config_flags(folder: Path) -> list[str]:
    """torch's C++ standard (its headers need C++20 from torch 2.14) and ``_GLIBCXX_USE_CXX11_ABI``, from
    its CMake config (C++17 and the compiler's default otherwise)."""
    flags = ["-std=c++17"]
    for config in folder.glob("share/cmake/Torch/TorchConfig.cmake"):
        text = config.read_text()
        standard = re.search(r"CXX_STANDARD\s+(\d+)", text)
        flags = [f"-std=c++{standard.group(1) if standard else 17}"]
        found = re.search(r"-D_GLIBCXX_USE_CXX11_ABI=([01])", text)
        if found:
            flags.append(f"-D_GLIBCXX_USE_CXX11_ABI={found.group(1)}")
    return flags


def compiler() -> str:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return name
    raise ShimError("the fake GPU builds a small C++ library against torch once (cached), and no C++ "
                    "compiler was found: install one (apt-get install g++) or set CXX")


def build_shim(folder: Path | None = None) -> Path:
    """The shim for this torch, built now if the cache lacks it (under a lock: ranks start together)."""
    from filelock import FileLock

    folder = folder or torch_dir()
    version, cuda = torch_build(folder)
    key = hashlib.sha256(SOURCE.read_bytes() + f"\0{version}\0{folder.resolve()}".encode()).hexdigest()[:16]
    # a CUDA build's: loaded with the shim (kept where a linker drops unused libraries), so that their
    # registrations run first and ours over them
    cuda_libs = ["-Wl,--no-as-needed", "-lc10_cuda", "-ltorch_cuda"] if cuda else []
    target = cache_dir() / f"fakecuda-{version.replace('+', '_')}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if target.exists():
            return target
        cxx = compiler()
        lib = folder / "lib"
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            out = Path(tmp) / target.name
            command = [cxx, "-O1", "-shared", "-fPIC", "-w", *_config_flags(folder),
                       f"-I{folder / 'include'}", str(SOURCE), "-o", str(out),
                       f"-L{lib}", "-lc10", "-ltorch_cpu", *cuda_libs, f"-Wl,-rpath,{lib}"]
            try:
                done = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
            except subprocess.TimeoutExpired as exc:
                raise ShimError(f"building the fake GPU's CUDA shim took over {BUILD_TIMEOUT_S:.0f} s") from exc
            if done.returncode != 0:
                tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-15:])
                raise ShimError(f"building the fake GPU's CUDA shim against torch {version} failed "
                                f"({' '.join(command[:2])} ...):\n{tail}")
            os.replace(out, target)  # atomic: a rank never loads half a library
    return target


def load(folder: Path | None = None) -> Path | None:
    """Build if need be and load the shim into this process (before torch); None where not needed."""
    folder = folder or torch_dir()
    if not needed(folder):
        return None
    path = build_shim(folder)
    try:
        ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    except OSError as exc:
        raise ShimError(f"the fake GPU's CUDA shim {path.name} did not load ({exc}): delete {path.parent} "
                        "to build it again") from exc
    return path
