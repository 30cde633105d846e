"""A user's own optimizer, importable by the workers (this folder is on their path) but not by the
shadows (which run in the test process): a shadow refuses the job it cannot replay."""

from __future__ import annotations

from typing import Any

import torch


class SignSGD(torch.optim.Optimizer):
    def __init__(self, params: Any, lr: float = 0.01) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(torch.sign(p.grad), alpha=-group["lr"])
