"""A CPU optimizer that keeps Transformer Engine's ``FusedAdam`` state layout.

Part of the CPU backend (:mod:`nemo_lw_fp8.cpu`): the ``cpu_fused_adam`` stand-in of
:mod:`nemo_lw_fp8.cpu.megatron.standins` hands this class to megatron wherever it would build TE's
``FusedAdam`` (whose step is a CUDA kernel).

Why not torch's ``AdamW``: megatron-core is written against FusedAdam's state. FusedAdam keeps
``exp_avg`` / ``exp_avg_sq`` per parameter and the step count in each *param group*; torch keeps
a per-parameter ``step`` tensor. megatron's ``init_state_fn`` seeds only the two moments, and
``DistributedOptimizer.state_dict`` / ``load_state_dict`` and the ``dp_reshardable`` /
``fully_reshardable`` checkpoint formats read and write that layout, so with torch's Adam a
checkpoint load on CPU fails (``KeyError: 'step'``, or ``state_dict`` asserting on a fresh
optimizer) where the GPU run works.

What is kept from TE 2.20.2's ``FusedAdam`` (``optimizers/fused_adam.py``) and its
``multi_tensor_adam`` kernel:

* the constructor signature megatron passes (``adam_w_mode``, ``bias_correction``, ...);
* ``group["step"]`` advanced once per ``step()`` in every group, empty groups included (TE does
  so, so that ranks sharing a state shard agree on the count);
* zero-initialised fp32 ``exp_avg`` / ``exp_avg_sq``, created at a parameter's first step or
  by :meth:`initialize_state`;
* the kernel's arithmetic in fp32, in its order: bias corrections ``1 - beta ** step`` computed
  on the host in double and rounded to float, ``m = b1 m + (1 - b1) g``,
  ``v = b2 v + (1 - b2) g g``, ``denom = sqrt(v / c2) + eps``, and for AdamW mode
  ``p -= lr (m / c1 / denom + wd p)`` (L2 mode adds ``wd p`` to the gradient first).

Not claimed: the last bits of a GPU run (nvcc may contract the multiply-adds into FMAs). Not
supported (each refused when asked for): master weights kept by the optimizer, non-fp32 or FP8
moments, ``capturable``, decoupled gradients, AMSGrad, a grad scaler passed to ``step``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["CPUFusedAdam"]


def _f32(value: float) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float32)


def _bias_correction(beta: float, step: int) -> torch.Tensor:
    """``1 - pow(beta, step)``: ``beta`` a float, the power and the difference in double (C++
    promotes ``std::pow(float, int)``), the result rounded to float as the kernel receives it."""
    beta32 = float(_f32(beta))
    return _f32(1.0 - beta32**step)


class CPUFusedAdam(torch.optim.Optimizer):
    """TE ``FusedAdam``'s state layout and update rule on CPU tensors (see the module doc)."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        *,
        bias_correction: bool = True,
        adam_w_mode: bool = True,
        capturable: bool = False,
        master_weights: bool = False,
        master_weight_dtype: torch.dtype = torch.float32,
        exp_avg_dtype: torch.dtype = torch.float32,
        exp_avg_sq_dtype: torch.dtype = torch.float32,
        use_decoupled_grad: bool = False,
        store_param_remainders: bool = False,
        set_grad_none: bool | None = None,
    ) -> None:
        refused = {
            "amsgrad": amsgrad,
            "capturable": capturable,
            "master_weights": master_weights,
            "use_decoupled_grad": use_decoupled_grad,
            "exp_avg_dtype != float32": exp_avg_dtype != torch.float32,
            "exp_avg_sq_dtype != float32": exp_avg_sq_dtype != torch.float32,
        }
        asked = [name for name, value in refused.items() if value]
        if asked:
            raise NotImplementedError(
                f"the CPU FusedAdam stand-in does not support {', '.join(asked)} (megatron's "
                "precision-aware optimizer / CUDA graphs need TE's CUDA FusedAdam); run with "
                "use_precision_aware_optimizer=False on CPU"
            )
        defaults = {
            "lr": lr,
            "bias_correction": bias_correction,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
        }
        super().__init__(params, defaults)
        self.adam_w_mode = 1 if adam_w_mode else 0
        self.master_weights = False
        self.capturable = False

    def initialize_state(self, param: torch.Tensor, store_param_remainders: bool = False) -> None:
        """Zeroed fp32 moments for ``param`` (TE's ``initialize_state`` without master weights)."""
        state = self.state[param]
        for name in ("exp_avg", "exp_avg_sq"):
            state[name] = torch.zeros_like(param, dtype=torch.float32)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's load (which casts state to each parameter's dtype), then, as TE does, every
        loaded state tensor kept as an fp32 copy of the saved value."""
        super().load_state_dict(state_dict)
        saved_ids = [index for group in state_dict["param_groups"] for index in group["params"]]
        params = [param for group in self.param_groups for param in group["params"]]
        by_id = dict(zip(saved_ids, params, strict=True))
        for index, saved in state_dict["state"].items():
            param = by_id.get(index)
            if param is None:
                continue
            self.state[param] = {
                name: value.detach().float().clone()
                for name, value in saved.items()
                if torch.is_tensor(value)
            }

    @torch.no_grad()
    def step(  # type: ignore[override]
        self, closure: Callable[[], Any] | None = None, grad_scaler: Any = None
    ) -> Any:
        if grad_scaler is not None:
            raise NotImplementedError("the CPU FusedAdam stand-in takes no grad_scaler")
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            for param in group["params"]:
                if len(self.state[param]) == 0:
                    self.initialize_state(param)
            params = [p for p in group["params"] if p.grad is not None]
            if params:
                self._update(group, params)
        return loss

    def _update(self, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        beta1, beta2 = group["betas"]
        b1, b2 = _f32(beta1), _f32(beta2)
        one_minus_b1, one_minus_b2 = _f32(1.0) - b1, _f32(1.0) - b2
        if group["bias_correction"]:
            c1 = _bias_correction(beta1, group["step"])
            c2 = _bias_correction(beta2, group["step"])
        else:
            c1 = c2 = _f32(1.0)
        lr, eps, decay = _f32(group["lr"]), _f32(group["eps"]), _f32(group["weight_decay"])
        for param in params:
            m, v = self.state[param]["exp_avg"], self.state[param]["exp_avg_sq"]
            g = param.grad.float()
            p = param.float()
            if not self.adam_w_mode:
                g = g + decay * p
            m.copy_(b1 * m + one_minus_b1 * g)
            v.copy_(b2 * v + one_minus_b2 * g * g)
            denom = torch.sqrt(v / c2) + eps
            update = (m / c1) / denom
            if self.adam_w_mode:
                update = update + decay * p
            param.copy_(p - lr * update)
