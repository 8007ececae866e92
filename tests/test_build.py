"""The kernel build's cache (g4ops/ops/_build.py), on CPU: as on a CUDA machine, with cpp_extension.load and
torch.ops.load_library recorded instead of run."""

from __future__ import annotations

import pytest
import torch
from torch.utils import cpp_extension

from g4ops.ops import _build


@pytest.fixture
def cuda_machine(monkeypatch, tmp_path):
    """A CUDA machine as far as build() looks (torch 2.11, CUDA 13.0, sm_90), its cache in tmp_path; returns
    (the calls made, the library path a build of the current sources would have)."""
    monkeypatch.setattr(_build, "_state", {"attempted": False, "loaded": False, "error": None, "library": None})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", "/usr/local/cuda")
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    monkeypatch.setenv("G4OPS_CACHE", str(tmp_path))
    calls = []

    def load(name, build_directory, **kwargs):
        calls.append(("build", name))
        return f"{build_directory}/{name}.so"

    def load_library(path):
        calls.append(("load", path))

    monkeypatch.setattr(cpp_extension, "load", load)
    monkeypatch.setattr(torch.ops, "load_library", load_library)
    tag = _build.build_tag(_build._sources() + _build._headers(), "9.0")
    return calls, tmp_path / tag / f"g4ops_cuda_{tag}.so"


def test_a_library_built_for_these_sources_loads_without_a_build_step(cuda_machine):
    """Copied in from another machine, its sources newer than it, ninja would rebuild it: the tag already says it is
    the build of exactly these sources, torch, CUDA and arch."""
    calls, library = cuda_machine
    library.parent.mkdir(parents=True)
    library.write_bytes(b"\x7fELF")
    assert _build.build() == str(library)
    assert calls == [("load", str(library))]


def test_no_library_for_this_tag_builds(cuda_machine):
    calls, library = cuda_machine
    other = library.parent.parent / "0123456789abcdef" / "g4ops_cuda_0123456789abcdef.so"  # another tag's build
    other.parent.mkdir(parents=True)
    other.write_bytes(b"\x7fELF")
    assert _build.build() == str(library)
    assert calls == [("build", library.stem)]


def test_a_library_that_does_not_load_is_removed_and_rebuilt(cuda_machine, monkeypatch):
    calls, library = cuda_machine
    library.parent.mkdir(parents=True)
    library.write_bytes(b"partial")

    def fails(path):
        calls.append(("load", path))
        raise OSError(f"{path}: file too short")

    monkeypatch.setattr(torch.ops, "load_library", fails)
    assert _build.build() == str(library)
    assert calls == [("load", str(library)), ("build", library.stem)]
    assert not library.exists(), "the partial file was removed before the build"
