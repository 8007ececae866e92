"""One traced graph runs on every NeuronCore: the check must see a rank baked into the module's Python.

NxD traces the module once, as built on rank 0, and runs that graph on each core with the core's own weights. The
mutation below takes the LM head's first vocab id from the Python rank (`comm.rank * vocab_local`) instead of the
per-rank `vocab_start` buffer. Each rank building its own module (the per-rank gloo run) cannot see it: every rank
has the right Python rank there. The rank-0-built run of `python -m neuron_backend check` must report it.
"""

from __future__ import annotations

import pytest
import torch

import g4ops
from neuron_backend.check import run_check
from neuron_backend.parallel import VocabParallelLMHead

pytest.importorskip("transformers.models.gemma4.modeling_gemma4")
pytestmark = pytest.mark.slow  # spawns processes


def _offset_from_python_rank(self):
    weight = self._embedding[0].weight if self.tied else self.weight
    return weight, torch.tensor(self.comm.rank * self.vocab_local)


def _apply_mutation():
    """Runs first in every rank process (spawned: the parent's monkeypatch does not reach them)."""
    VocabParallelLMHead._weight_and_start = _offset_from_python_rank


def test_check_reports_a_rank_read_from_python(monkeypatch):
    g4ops.disable()
    monkeypatch.setattr(VocabParallelLMHead, "_weight_and_start", _offset_from_python_rank)
    report = run_check("tiny-e4b", tp=2, export=False, setup=_apply_mutation)
    text = "\n".join(report.lines())
    assert report.seq_match_stock  # TP=1: the Python rank is 0, which is right there
    assert report.seq_match_tp, text  # each rank's own build: blind to the mutation
    assert report.seq_match_rank0 is False, text  # one graph built as rank 0: rank 1's token ids are off
    assert report.rank0_first_divergence is not None
    assert not report.ok and "SEQ_MATCH False" in text.splitlines()[-1]
