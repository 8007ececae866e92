"""Generation without transformers' generate (design.md section 2): the KV cache, the captured decode step and the
sampler. Knows models as modules, not configs; nothing here patches transformers."""
