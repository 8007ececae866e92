"""Build the CUDA kernels here, without a GPU, for the GPU image: the gzipped library goes to .prebuilt/, which a
device call carries (carry [".prebuilt"]) and bench/gpu_round.sh's build stage loads instead of building, saving
the 70-90 s a build takes on each fresh machine.

The image uses the library only if its tag matches (g4ops/ops/_build.py `build_tag`: the sources, torch's and
CUDA's versions, the arch list), so this must run under the image's torch, 2.11.0+cu130 (the venv that
`bash .ci/gpu-image-stack` makes has that build, CUDA headers included under site-packages/nvidia/), with nvcc 13.0
(here, as there) and the image's TORCH_CUDA_ARCH_LIST, 9.0a: the tag of session 55's library built there,
48f6ab9dcdf60da9, is that of 9.0a (gpu_round.sh's default too), not of 9.0. A library that does not load there is
removed and rebuilt (`_load_built`), so a mismatch costs the build, nothing else.

    python3 -m venv /tmp/v211 && /tmp/v211/bin/pip install torch==2.11.0 \
      && /tmp/v211/bin/pip install -e ".[test]" transformers==5.17.0    # the image's stack, as .ci/gpu-image-stack
    CUDA_HOME=/usr/local/cuda /tmp/v211/bin/python bench/prebuild.py    # about 3 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import gzip
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from g4ops.ops import _build

ROOT = Path(__file__).resolve().parent.parent


def cuda_headers() -> list[Path]:
    """The CUDA headers a torch cu13x wheel brings (cusparse.h and others that torch's CUDA headers include)."""
    site = Path(torch.__file__).resolve().parent.parent
    return sorted(site.glob("nvidia/*/include"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="9.0a", help="TORCH_CUDA_ARCH_LIST of the machine that will load it")
    parser.add_argument("--out", default=str(ROOT / ".prebuilt"))
    args = parser.parse_args()
    if torch.version.cuda is None:
        sys.exit(f"torch {torch.__version__} is a CPU build: run this under the GPU image's torch (2.11.0+cu130)")
    os.environ["TORCH_CUDA_ARCH_LIST"] = args.arch
    tag = _build.build_tag(_build._sources() + _build._headers(), args.arch)
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, arch {args.arch}: tag {tag}", flush=True)
    start = time.time()
    with tempfile.TemporaryDirectory() as build_dir:
        library = Path(_build.compile_library(tag, Path(build_dir), include_paths=cuda_headers()))
        out = Path(args.out) / f"{library.name}.gz"
        out.parent.mkdir(parents=True, exist_ok=True)
        with library.open("rb") as src, gzip.open(out, "wb", compresslevel=9) as dst:
            shutil.copyfileobj(src, dst)
    print(f"built in {time.time() - start:.0f} s: {out} ({out.stat().st_size / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
