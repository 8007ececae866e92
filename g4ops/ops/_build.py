"""Build and load the CUDA kernels in csrc/ (JIT, cached per torch / CUDA / GPU arch / source hash).

The kernels register themselves for the CUDA dispatch key of the ops declared in core.py (TORCH_LIBRARY_IMPL), so
loading the shared library is all it takes. A CPU-only machine never builds anything.

On a machine with a GPU, a failed build raises `KernelBuildError` saying why, unless the user asked for the
reference fallback (`G4OPS_ALLOW_REFERENCE=1` or `g4ops.allow_reference_fallback()`): silently slow is a bug.
"""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

import torch

from ._torch_version import torch_too_old

CSRC_DIR = Path(__file__).resolve().parent.parent.parent / "csrc"
MIN_CAPABILITY = (8, 0)  # bf16 arithmetic and cp.async; everything older is refused with a clear message


class KernelBuildError(RuntimeError):
    """The CUDA kernels could not be built or loaded; the message says why and how to fix it."""


_lock = threading.Lock()
_state: dict = {"attempted": False, "loaded": False, "error": None, "library": None}
_allow_reference = os.environ.get("G4OPS_ALLOW_REFERENCE", "") == "1"


def allow_reference_fallback(allowed: bool = True) -> None:
    """Let CUDA tensors use the (slower) reference kernels when the compiled kernels cannot be built."""
    global _allow_reference
    _allow_reference = allowed


def _sources() -> list[Path]:
    if not CSRC_DIR.is_dir():
        raise KernelBuildError(
            f"csrc/ not found at {CSRC_DIR}: install g4ops from a source checkout (`pip install -e .`)"
        )
    return sorted(p for p in CSRC_DIR.iterdir() if p.suffix in (".cpp", ".cu"))


def _headers() -> list[Path]:
    return sorted(p for p in CSRC_DIR.iterdir() if p.suffix in (".h", ".cuh"))


def _arch_list() -> str:
    if os.environ.get("TORCH_CUDA_ARCH_LIST"):
        return os.environ["TORCH_CUDA_ARCH_LIST"]
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < MIN_CAPABILITY:
        raise KernelBuildError(
            f"GPU compute capability {major}.{minor} is not supported: g4ops kernels need sm_80 or newer"
        )
    return f"{major}.{minor}"


def build_tag(sources: list[Path], arch: str) -> str:
    """Cache key: torch and CUDA versions, target arch and the content of every source file."""
    digest = hashlib.sha256()
    for part in (torch.__version__, str(torch.version.cuda), arch):
        digest.update(part.encode())
    for path in sources:
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def cache_dir() -> Path:
    root = os.environ.get("G4OPS_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "g4ops"
    )
    return Path(root)


_LIBRARY_SUFFIX = ".so"  # what cpp_extension.load names the library it links on Linux


def _load_built(library: Path, verbose: bool) -> str | None:
    """Load a library already built for this tag, without cpp_extension's ninja step: the tag names the exact
    sources, torch, CUDA and arch, so the file is what a build would give. That holds also for a library copied in
    from another machine (bench/gpu_round.sh's SAVE_BUILD), which ninja, judging by file times that a copy does not
    keep in order, might rebuild. None when there is none, or it does not load (a partial file: removed, then
    rebuilt)."""
    if not library.is_file():
        return None
    try:
        torch.ops.load_library(str(library))
    except OSError as exc:
        if verbose:
            print(f"g4ops: the cached {library} did not load ({exc}); rebuilding")
        library.unlink()
        return None
    if verbose:
        print(f"g4ops: loaded the cached build {library}")
    return str(library)


def compile_library(tag: str, build_dir: Path, verbose: bool = False, include_paths=()) -> str:
    """cpp_extension.load of csrc/ as the library `g4ops_cuda_{tag}` in build_dir, for the arch TORCH_CUDA_ARCH_LIST
    names; it also loads it. include_paths: more header folders (bench/prebuild.py's CUDA headers)."""
    from torch.utils import cpp_extension

    return cpp_extension.load(
        name=f"g4ops_cuda_{tag}",
        sources=[str(p) for p in _sources()],
        extra_cflags=["-O3"],
        extra_cuda_cflags=["-O3", "-lineinfo"],
        extra_include_paths=[str(p) for p in include_paths],
        build_directory=str(build_dir),
        is_python_module=False,
        verbose=verbose,
    )


def build(verbose: bool = False) -> str:
    """Compile (or reuse from the cache) and load the CUDA kernels; returns the loaded library path."""
    from torch.utils import cpp_extension

    with _lock:
        if _state["loaded"]:
            return _state["library"]
        _state["attempted"] = True
        try:
            if not torch.cuda.is_available():
                raise KernelBuildError("CUDA is not available to torch: nothing to build (CPU uses the reference)")
            if torch.version.cuda is None:
                raise KernelBuildError(f"torch {torch.__version__} is a CPU-only build: install a CUDA build of torch")
            too_old = torch_too_old("the g4ops CUDA kernels")
            if too_old:
                raise KernelBuildError(too_old)
            if cpp_extension.CUDA_HOME is None:
                raise KernelBuildError("no CUDA toolkit found (nvcc): install it or set CUDA_HOME")
            sources = _sources()
            if not sources:
                raise KernelBuildError(f"no .cpp/.cu sources in {CSRC_DIR}")
            arch = _arch_list()
            os.environ["TORCH_CUDA_ARCH_LIST"] = arch
            tag = build_tag(sources + _headers(), arch)  # headers too: an edited .cuh must rebuild
            build_dir = cache_dir() / tag
            build_dir.mkdir(parents=True, exist_ok=True)
            library = _load_built(build_dir / f"g4ops_cuda_{tag}{_LIBRARY_SUFFIX}", verbose)
            if library is None:
                library = compile_library(tag, build_dir, verbose)
        except KernelBuildError as exc:
            _state["error"] = str(exc)
            raise
        except Exception as exc:  # compiler errors, linker errors, missing ninja, ...
            _state["error"] = f"{type(exc).__name__}: {exc}"
            raise KernelBuildError(f"building the g4ops CUDA kernels failed: {_state['error']}") from exc
        _state["loaded"] = True
        _state["library"] = str(library) if library is not None else str(build_dir)
        return _state["library"]


def ensure_cuda_kernels() -> bool:
    """Called by a reference kernel that received a CUDA tensor. Returns True when this call has just loaded the
    compiled kernels (the caller re-dispatches to them); False when it should run the reference (kernels already
    tried and the fallback is allowed, or loaded but without a kernel for this op)."""
    if _state["loaded"] or (_state["attempted"] and _allow_reference):
        return False
    if _state["attempted"] and not _allow_reference:
        raise KernelBuildError(
            f"g4ops CUDA kernels are unavailable ({_state['error']}); set G4OPS_ALLOW_REFERENCE=1 to run the "
            "slower reference kernels on the GPU"
        )
    try:
        build()
    except KernelBuildError:
        if _allow_reference:
            return False
        raise
    return True


def status() -> dict:
    """What `python -m g4ops doctor` prints: whether the kernels were tried, loaded, and why not."""
    return dict(_state, allow_reference=_allow_reference)
