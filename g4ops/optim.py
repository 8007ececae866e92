"""g4ops.optim.AdamW: torch.optim.AdamW whose update is one g4ops kernel launch per parameter.

Why: on Gemma-4 E4B (7.46 B bf16 parameters in 623 tensors) the AdamW update moves 104 GB per step. On the H200
torch's fused AdamW took 40.2 ms for it and this one 32.3 ms, against a 24.6 ms copy floor (bench/adamw.py,
2026-11-30). torch's kernel computes the moments in double, which makes it compute-bound there; csrc/adamw.cu
computes in fp32 and streams each tensor with a grid that fills the GPU and 16-byte vectors.

What stays torch's: the constructor arguments, param groups, hooks, LR schedulers, zero_grad and the state
(`step`, `exp_avg`, `exp_avg_sq` under the same keys), so state dicts load into and from torch.optim.AdamW. The
update is AdamW in fp32 with one rounding per stored value (g4ops/ops/reference.py `adamw_step`); against an fp64
oracle its error is no larger than torch's fused AdamW's (tests/test_adamw.py). The step count lives on the
parameter's device as a float32 tensor (as with torch's fused=True), so no step syncs with the host and a CUDA graph
can capture it.

Not supported, with an error that says so: amsgrad, maximize, differentiable, a tensor lr or betas, sparse or
complex gradients. With torch.amp.GradScaler it is an ordinary optimizer: the scaler unscales the gradients and
skips a step with infs itself.
"""

from __future__ import annotations

import torch

from . import ops


class AdamW(torch.optim.AdamW):
    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, *, maximize: bool = False,
                 differentiable: bool = False):  # fmt: skip
        for name, value in (("lr", lr), ("betas[0]", betas[0]), ("betas[1]", betas[1])):
            if isinstance(value, torch.Tensor):
                raise TypeError(f"g4ops.optim.AdamW: `{name}` must be a Python float, not a tensor")
        for name, on in (("amsgrad", amsgrad), ("maximize", maximize), ("differentiable", differentiable)):
            if on:
                raise ValueError(f"g4ops.optim.AdamW does not support {name}=True; use torch.optim.AdamW for it")
        # torch validates the ranges and builds the param groups; foreach/fused stay off so that torch never runs
        # its own update for these groups.
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=False, fused=False)

    def _group_lists(self, group: dict):
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse or p.is_complex():
                raise TypeError(f"g4ops.optim.AdamW: sparse or complex gradients are not supported (parameter of shape "
                                f"{list(p.shape)}, {p.dtype}); use torch.optim.AdamW")  # fmt: skip
            state = self.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            elif state["step"].device != p.device or state["step"].dtype != torch.float32:
                # a state dict from a non-fused torch.optim.AdamW keeps the count on the CPU
                state["step"] = state["step"].to(device=p.device, dtype=torch.float32)
            params.append(p)
            grads.append(p.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        return params, grads, exp_avgs, exp_avg_sqs, steps

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group.get("amsgrad") or group.get("maximize") or group.get("differentiable"):
                raise ValueError("g4ops.optim.AdamW: a param group turned on amsgrad, maximize or differentiable, "
                                 "which it does not support")  # fmt: skip
            params, grads, exp_avgs, exp_avg_sqs, steps = self._group_lists(group)
            if not params:
                continue
            torch._foreach_add_(steps, 1.0)
            beta1, beta2 = group["betas"]
            ops.adamw_step(params, grads, exp_avgs, exp_avg_sqs, steps, lr=group["lr"], beta1=beta1, beta2=beta2,
                           weight_decay=group["weight_decay"], eps=group["eps"])  # fmt: skip
        return loss
