"""One way for an op's own elementwise math to run through torch.compile from inside the op (loss.py, lora.py):
Inductor fuses it into a few kernels, the op stays opaque to an outer torch.compile, and a compiler failure costs
speed, never the step."""

from __future__ import annotations

import warnings

import torch

# Dynamo compiles a function once per input signature it cannot generalise (list lengths, constant flags, dtypes), up
# to `torch._dynamo.config.recompile_limit` (8) signatures; with fullgraph=True a new one past that raises this (an
# empty tuple, matching nothing, on a torch without it).
_RECOMPILE_LIMIT_HIT = getattr(torch._dynamo.exc, "FailOnRecompileLimitHit", ())
_past_limit_warned: set = set()


def run_compiled(fn, args: tuple, setting: str | None, compiled: dict, failed: list, what: str):
    """`fn(*args)` compiled (dynamic shapes, one cache entry per fn in `compiled`) when `setting` (the op's
    environment switch) is "1", or unset and args[0] is on CUDA; eagerly when it is "0" or a compilation failed
    before (`failed` holds why; the first failure warns, naming `what` and fn). A call whose input signature is one
    past Dynamo's recompile limit runs eagerly alone: the signatures compiled so far stay compiled (the first such
    call warns)."""
    wanted = setting == "1" or (setting is None and args[0].device.type == "cuda")
    if not wanted or failed:
        return fn(*args)
    runner = compiled.get(fn)
    if runner is None:
        runner = compiled[fn] = torch.compile(fn, dynamic=True, fullgraph=True)
    try:
        # Always below autograd and ADInplaceOrView (these are steps of an op with its own backward): Dynamo guards
        # on the inputs' dispatch keys after the thread's exclusions, and the op is reached with those keys
        # excluded and without (H200, 2026-12-01: a compiled training step's first call saw them excluded, the
        # second not, and the loss helpers recompiled); from inference mode too.
        with torch._C._AutoDispatchBelowADInplaceOrView():
            return runner(*args)
    except Exception as exc:  # noqa: BLE001 - slower but correct beats failing the training step
        if isinstance(exc, torch.OutOfMemoryError):
            raise
        where = f"{what} ({fn.__name__})"
        if isinstance(exc, _RECOMPILE_LIMIT_HIT):
            if where not in _past_limit_warned:
                _past_limit_warned.add(where)
                limit = getattr(torch._dynamo.config, "recompile_limit", "?")
                warnings.warn(f"{where}: a new input signature past torch._dynamo.config.recompile_limit ({limit}) "
                              "runs eagerly (slower, same results); the signatures compiled before stay compiled",
                              stacklevel=3)  # fmt: skip
            return fn(*args)
        failed.append(repr(exc))
        warnings.warn(f"{where} failed ({exc!r}); running it eagerly from now on (slower, same results)",
                      stacklevel=3)  # fmt: skip
        return fn(*args)
