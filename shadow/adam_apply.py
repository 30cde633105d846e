"""torch.optim's single-tensor Adam/AdamW step, cache-blocked and on a thread pool, bit for bit.

The workers' CPU Adam and AdamW (``foreach`` off, as torch picks on CPU; not fused, not
capturable, not differentiable, no amsgrad, no maximize, float parameters and lr) run
``torch.optim.adam._single_tensor_adam``: per parameter, six elementwise passes over the
whole tensor, two of them into freshly allocated temporaries. :class:`AdamApply` runs the
same torch operations, in the same order, with the same Python-float scalars, but on
blocks of :data:`BLOCK` elements at a time (one reused scratch block per thread instead of
two temporaries per parameter) and, with more than one thread, on different blocks at
once: a shard's step takes 1/threads of the time (torch releases the GIL in each
operation), the CPU time stays the same. A shard smaller than :data:`MIN_PER_THREAD`
elements per thread uses fewer threads (a TinyLM-sized shard one: handing blocks to
threads would cost more than it gains).

Why the blocks are bit-exact: every operation is elementwise, and torch's CPU kernel for
a contiguous 1-D operand runs its vector loop over whole groups of ``2 * Vectorized::size()``
elements from the start and a scalar loop over the rest. A block boundary at a multiple of
:data:`BLOCK` (a multiple of every such group: 64 elements at most) leaves each element
in the loop that computes it in the whole-tensor call; the scalar tail stays the tail of
the last block. Like the workers (and torch.optim on the shadow), this holds with one torch
intra-op thread, which the shadow runs (``torch.set_num_threads(1)``): torch's own threads
would split a large operand at points of their choosing.
Each block is computed by one thread from its own elements only, so the thread count
changes which core computes an element, never how.

It is checked, not assumed: :func:`verified` runs this path and ``torch.optim`` side by
side on probe tensors (several blocks and an odd tail) with the group's hyperparameters
before a shadow uses it, and the shadow falls back to ``optimizer.step()`` (one thread)
for any group this path does not cover or when the probe differs (logged once).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping, MutableMapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)

BLOCK = 1 << 18
"""Elements per block (1 MiB of fp32): the unit a thread takes, a multiple of every vector group."""

MIN_PER_THREAD = 1 << 20
"""Elements a thread must have to be worth starting: a TinyLM-sized shard steps on one thread."""

_CLASSES = ("torch.optim.adam.Adam", "torch.optim.adamw.AdamW")


def default_threads() -> int:
    """The cores this process may run on (``os.sched_getaffinity``)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def covers(optimizer: torch.optim.Optimizer, group: Mapping[str, Any]) -> bool:
    """Whether this path computes ``group``'s step exactly as ``optimizer.step()`` would."""
    kind = type(optimizer)
    if f"{kind.__module__}.{kind.__qualname__}" not in _CLASSES:
        return False
    flags_off = all(not group.get(k) for k in ("foreach", "fused", "capturable", "differentiable"))
    if not flags_off or group.get("amsgrad") or group.get("maximize"):
        return False
    betas = group.get("betas")
    scalars = [group.get("lr"), group.get("eps"), group.get("weight_decay")]
    if not isinstance(betas, tuple) or len(betas) != 2:
        return False
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in [*scalars, *betas])


def _decoupled(optimizer: torch.optim.Optimizer, group: Mapping[str, Any]) -> bool:
    return bool(group.get("decoupled_weight_decay", type(optimizer).__name__ == "AdamW"))


@dataclass
class _Item:
    """One parameter's step: its flat tensors and the Python-float scalars torch computes."""

    param: torch.Tensor
    grad: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    decay: float | None
    """``1 - lr * weight_decay`` (decoupled), else None."""
    l2: float
    """Coupled weight decay (``grad + weight_decay * param``); 0: none."""
    one_minus_beta1: float
    beta2: float
    one_minus_beta2: float
    bias_correction2_sqrt: float
    eps: float
    neg_step_size: float


def _usable(param: torch.Tensor, grad: torch.Tensor, state: Mapping[str, Any]) -> bool:
    if param.dtype not in (torch.float32, torch.float64) or not param.is_contiguous():
        return False
    if grad.dtype != param.dtype or not grad.is_contiguous() or grad.is_sparse or grad.shape != param.shape:
        return False
    if not state:
        return True
    step = state.get("step")
    if not isinstance(step, torch.Tensor) or step.dim() != 0 or step.requires_grad:
        return False
    for key in ("exp_avg", "exp_avg_sq"):
        t = state.get(key)
        if not isinstance(t, torch.Tensor) or t.dtype != param.dtype or t.shape != param.shape:
            return False
        if not t.is_contiguous():
            return False
    return set(state) == {"step", "exp_avg", "exp_avg_sq"}


class AdamApply:
    """Steps the Adam/AdamW groups of one optimizer with ``threads`` threads (see the module)."""

    def __init__(self, threads: int = 1) -> None:
        self.threads = max(1, threads)
        self._pool = (
            ThreadPoolExecutor(self.threads, thread_name_prefix="shadow-adam") if self.threads > 1 else None
        )
        self._scratch = threading.local()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)

    def step(
        self,
        optimizer: torch.optim.Optimizer,
        groups: Sequence[MutableMapping[str, Any]],
    ) -> list[torch.Tensor]:
        """Step every parameter with a gradient in ``groups``; returns those it could not take.

        Parameters it returns (an unusual layout or state) must be stepped by torch.optim;
        the caller does that with the others' gradients cleared.
        """
        items: list[_Item] = []
        left: list[torch.Tensor] = []
        state = optimizer.state
        for group in groups:
            beta1, beta2 = group["betas"]
            lr, eps, weight_decay = group["lr"], group["eps"], group["weight_decay"]
            decoupled = _decoupled(optimizer, group)
            for param in group["params"]:
                grad = param.grad
                if grad is None:
                    continue
                pstate = state[param]
                if not _usable(param, grad, pstate):
                    left.append(param)
                    continue
                if len(pstate) == 0:  # as torch's _init_group, in its key order
                    scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
                    pstate["step"] = torch.tensor(0.0, dtype=scalar, device="cpu")
                    pstate["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                    pstate["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                step_t = pstate["step"]
                step_t += 1
                step = step_t.item()
                bias_correction1 = 1 - beta1**step
                bias_correction2 = 1 - beta2**step
                step_size = lr / bias_correction1
                flat = param.numel() > BLOCK  # blocks are 1-D views; a one-block parameter is used as is
                exp_avg, exp_avg_sq = pstate["exp_avg"], pstate["exp_avg_sq"]
                items.append(
                    _Item(
                        param.view(-1) if flat else param,
                        grad.view(-1) if flat else grad,
                        exp_avg.view(-1) if flat else exp_avg,
                        exp_avg_sq.view(-1) if flat else exp_avg_sq,
                        (1 - lr * weight_decay) if weight_decay != 0 and decoupled else None,
                        weight_decay if weight_decay != 0 and not decoupled else 0.0,
                        1 - beta1,
                        beta2,
                        1 - beta2,
                        bias_correction2**0.5,
                        eps,
                        -step_size,
                    )
                )
        self._run(items)
        return left

    def _run(self, items: list[_Item]) -> None:
        blocks = [(item, start) for item in items for start in range(0, item.param.numel(), BLOCK)]
        threads = min(self.threads, sum(item.param.numel() for item in items) // MIN_PER_THREAD, len(blocks))
        if self._pool is None or threads < 2:
            self._blocks(blocks)
            return
        share = -(-len(blocks) // threads)
        futures = [
            self._pool.submit(self._blocks, blocks[i : i + share]) for i in range(share, len(blocks), share)
        ]
        self._blocks(blocks[:share])
        for future in futures:
            future.result()

    def _blocks(self, blocks: Sequence[tuple[_Item, int]]) -> None:
        with torch.no_grad():  # grad mode is per thread: a pool thread's is on
            self._blocks_no_grad(blocks)

    def _blocks_no_grad(self, blocks: Sequence[tuple[_Item, int]]) -> None:
        scratch: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = getattr(self._scratch, "buffers", {})
        self._scratch.buffers = scratch
        for item, start in blocks:
            numel = item.param.numel()
            stop = min(start + BLOCK, numel)
            n = stop - start
            if n == numel:  # the whole parameter: no views to make
                param, grad, exp_avg, exp_avg_sq = item.param, item.grad, item.exp_avg, item.exp_avg_sq
            else:
                param = item.param[start:stop]
                grad = item.grad[start:stop]
                exp_avg = item.exp_avg[start:stop]
                exp_avg_sq = item.exp_avg_sq[start:stop]
            buffers = scratch.get(param.dtype)
            if buffers is None:
                buffers = scratch[param.dtype] = (
                    torch.empty(BLOCK, dtype=param.dtype),
                    torch.empty(BLOCK, dtype=param.dtype),
                )
            denom = buffers[0][:n].view(param.shape)
            if item.decay is not None:
                param.mul_(item.decay)
            elif item.l2 != 0:
                grad = torch.add(grad, param, alpha=item.l2, out=buffers[1][:n].view(param.shape))
            exp_avg.lerp_(grad, item.one_minus_beta1)
            exp_avg_sq.mul_(item.beta2).addcmul_(grad, grad, value=item.one_minus_beta2)
            torch.sqrt(exp_avg_sq, out=denom)
            denom.div_(item.bias_correction2_sqrt).add_(item.eps)
            param.addcdiv_(exp_avg, denom, value=item.neg_step_size)


def verified(optimizer: torch.optim.Optimizer, group: Mapping[str, Any], dtype: torch.dtype) -> bool:
    """Whether :class:`AdamApply` gives ``optimizer``'s class the same bits as torch for ``group``.

    Three steps on probe tensors of several blocks and an odd tail (and a one-element one),
    with the group's hyperparameters and the thread counts 1 and 2.
    """
    kind: Any = type(optimizer)
    hyper = {k: v for k, v in group.items() if k != "params"}
    start, grads = _probe_tensors((3 * BLOCK + 37, 1, 129), 12345, dtype)
    try:
        reference, torch_opt = _torch_steps(kind, hyper, start, grads)
    except (TypeError, ValueError, RuntimeError) as exc:
        logger.info("the blocked Adam path is not probed for %s: %s", kind.__name__, exc)
        return False
    for threads in (1, 2):
        mine = [p.clone().requires_grad_() for p in start]
        shell = kind([{**hyper, "params": mine}])
        runner = AdamApply(threads)
        try:
            for step_grads in grads:
                for p, g in zip(mine, step_grads, strict=True):
                    p.grad = g.clone()
                with torch.no_grad():
                    if runner.step(shell, shell.param_groups):
                        return False
        finally:
            runner.close()
        for a, b in zip(reference, mine, strict=True):
            theirs, ours = torch_opt.state[a], shell.state[b]
            same = torch.equal(a.detach(), b.detach()) and all(
                torch.equal(theirs[k], ours[k]) for k in ("step", "exp_avg", "exp_avg_sq")
            )
            if not same:
                logger.warning(
                    "the blocked Adam path differs from torch.optim.%s on this machine: the shadow "
                    "steps with optimizer.step() on one thread",
                    kind.__name__,
                )
                return False
    return True


def foreach_matches(optimizer: torch.optim.Optimizer, group: Mapping[str, Any], dtype: torch.dtype) -> bool:
    """Whether torch's own foreach Adam/AdamW gives the same bits as its single-tensor one for ``group``.

    On CPU torch's ``_foreach_*`` operations loop over the tensors calling the very kernels the
    single-tensor step calls, with the same Python-float scalars, so they should; this probe
    (three steps, tensors of odd sizes, the group's hyperparameters) checks it on this machine.
    """
    kind: Any = type(optimizer)
    hyper = {k: v for k, v in group.items() if k != "params"}
    start, grads = _probe_tensors((3 * 16384 + 37, 1, 129, 40000), 54321, dtype)
    results = []
    for foreach in (False, True):
        try:
            params, opt = _torch_steps(kind, {**hyper, "foreach": foreach}, start, grads)
        except (TypeError, ValueError, RuntimeError) as exc:
            logger.info("torch's foreach %s is not probed: %s", kind.__name__, exc)
            return False
        results.append([(p.detach(), *(opt.state[p][k] for k in sorted(opt.state[p]))) for p in params])
    same = all(torch.equal(a, b) for x, y in zip(*results, strict=True) for a, b in zip(x, y, strict=True))
    if not same:
        logger.warning("torch's foreach %s differs from its single-tensor step here: not used", kind.__name__)
    return same


def _probe_tensors(
    sizes: Sequence[int], seed: int, dtype: torch.dtype
) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """Start values and three steps' gradients for a probe."""
    generator = torch.Generator().manual_seed(seed)
    start = [torch.randn(n, generator=generator, dtype=dtype) for n in sizes]
    grads = [[torch.randn(n, generator=generator, dtype=dtype) for n in sizes] for _ in range(3)]
    return start, grads


def _torch_steps(
    kind: Any,
    hyper: Mapping[str, Any],
    start: Sequence[torch.Tensor],
    grads: Sequence[Sequence[torch.Tensor]],
) -> tuple[list[torch.Tensor], torch.optim.Optimizer]:
    """torch.optim's ``kind`` with ``hyper`` stepped over ``grads`` from ``start``."""
    params = [p.clone().requires_grad_() for p in start]
    opt = kind([{**hyper, "params": params}])
    for step_grads in grads:
        for p, g in zip(params, step_grads, strict=True):
            p.grad = g.clone()
        opt.step()
    return params, opt
