"""Hypothesis profiles. CI (.ci/run) sets HYPOTHESIS_PROFILE=ci: the property tests draw the same examples on every
run, so a red CI is reproducible and a green one does not hang on a lucky draw; local runs keep drawing new ones.
A randomized run on 2026-12-06 found test_sandwich_norm_no_less_accurate_than_stock failing at fp16, x [1, 3, 2]
(rowstep, fp32 weights, scale 1.0, seed 474): g4ops' dpre error 5.07e-4 against stock's 3.59e-4 (about 1 seed in
300 of that shape); not yet explained."""

import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))
