"""PyTorch references of the three flash-linear-attention (fla) kernels megatron's Gated DeltaNet
calls, so the hybrid recipes (Qwen3-Next, Qwen3.5) train on CPU.

Part of the CPU backend (:mod:`nemo_lw_fp8.cpu`). megatron-core 0.19.2's ``GatedDeltaNet``
(``megatron/core/ssm/gated_delta_net``) imports from fla 0.6 and calls, in its training forward:

``causal_conv1d``
    fla's Triton depthwise causal convolution (``fla.modules.causal_conv1d``) over q / k / v.
``l2norm``
    fla's Triton L2 normalisation of q and k (``fla.modules.l2norm``).
``chunk_gated_delta_rule``
    fla's chunked Triton gated delta rule (``fla.ops.gated_delta_rule``).

Triton kernels do not run on CPU tensors. The functions here take fla's signatures and compute
the same math in fp32 as the kernels do (inputs upcast, fp32 accumulation, outputs cast back as
fla casts them; float64 inputs are kept in float64, which the tests use to check the algebra
exactly). ``chunk_gated_delta_rule`` uses fla's own chunked (WY) formulation with chunks of 64;
autograd provides the backward. Arguments megatron never passes and that have no CPU meaning
(fla's context-parallel ``cp_context``; the convolution's carried states) raise.

Where they are used: :func:`install_into_megatron` (the CPU stand-in ``gated_delta_rule`` of
:mod:`nemo_lw_fp8.cpu.megatron.standins`) puts them where megatron looks them up. Each installed
function still hands CUDA tensors to fla when fla is importable: a working kernel is never shadowed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["causal_conv1d", "chunk_gated_delta_rule", "install_into_megatron", "l2norm"]

#: fla's chunk length (``chunk_size`` 64 unless asked otherwise: 16, 32 or 64).
CHUNK_SIZE = 64


def _compute_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """fp32, as fla's kernels accumulate; float64 when an input already is (tests)."""
    if any(t is not None and t.dtype == torch.float64 for t in tensors):
        return torch.float64
    return torch.float32


def _unsupported(name: str, value: Any, why: str) -> None:
    if value is not None and value is not False:
        raise NotImplementedError(
            f"the CPU reference of fla's kernels does not take {name}={value!r} ({why}); "
            "megatron's GatedDeltaNet training forward never passes it"
        )


# ----------------------------------------------------------------------------------- l2norm


def l2norm(
    x: torch.Tensor, eps: float = 1e-6, output_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """fla's ``l2norm``: ``x / sqrt(sum(x^2) + eps)`` over the last dimension, in fp32, cast to
    ``output_dtype`` (default: ``x``'s dtype) as the kernel stores it."""
    xf = x.to(_compute_dtype(x))
    rstd = 1 / torch.sqrt((xf * xf).sum(dim=-1, keepdim=True) + eps)
    return (xf * rstd).to(output_dtype or x.dtype)


# ---------------------------------------------------------------------------- causal_conv1d


def _conv_one(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None
) -> torch.Tensor:
    """[B, T, D] fp32 -> [B, T, D] fp32: taps summed oldest first from zero, as the kernel."""
    width = weight.shape[-1]
    length = x.shape[1]
    y = torch.zeros_like(x)
    for tap in range(width):
        shift = width - 1 - tap  # tap reads x[t - shift]
        if shift >= length:
            continue
        shifted = torch.nn.functional.pad(x[:, : length - shift], (0, 0, shift, 0))
        y = y + shifted * weight[:, tap]
    if bias is not None:
        y = y + bias
    if activation in ("silu", "swish"):
        y = y * torch.sigmoid(y)
    elif activation is not None:
        raise ValueError(f"causal_conv1d: activation {activation!r}; fla takes silu/swish/None")
    return y


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool | None = False,
    activation: str | None = None,
    backend: str | None = "triton",
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.LongTensor | None = None,
    chunk_indices: torch.LongTensor | None = None,
    cp_context: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fla's ``causal_conv1d`` (``x`` [B, T, D], ``weight`` [D, W]): per channel
    ``y_t = act(sum_w x_{t-W+1+w} * weight_w + bias) (+ residual)``, zeros before each
    sequence (``cu_seqlens``: packed sequences, B = 1), fp32, cast to ``x``'s dtype. Returns
    ``(y, None)``; ``backend`` and ``chunk_indices`` select kernels and change nothing here."""
    _unsupported("initial_state", initial_state, "carried convolution state")
    _unsupported("output_final_state", output_final_state, "carried convolution state")
    _unsupported("cp_context", cp_context, "fla's context parallelism")
    if weight is None:
        raise ValueError("causal_conv1d: the CPU reference needs the convolution weight")
    dtype = _compute_dtype(x, weight)
    xf, wf = x.to(dtype), weight.to(dtype)
    bf = None if bias is None else bias.to(dtype)
    if cu_seqlens is None:
        y = _conv_one(xf, wf, bf, activation)
    else:
        if x.shape[0] != 1:
            raise ValueError("causal_conv1d: packed sequences (cu_seqlens) need batch size 1")
        edges = [int(e) for e in cu_seqlens.tolist()]
        pieces = [xf[:, s:e] for s, e in zip(edges[:-1], edges[1:], strict=True)]
        y = torch.cat([_conv_one(piece, wf, bf, activation) for piece in pieces], dim=1)
    if residual is not None:
        y = y + residual.to(dtype)
    return y.to(x.dtype), None


# ------------------------------------------------------------------- chunk_gated_delta_rule


def _gated_delta_chunks(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence batch in head-first layout: q, k [B, H, T, K] (q already scaled),
    v [B, H, T, V], g, beta [B, H, T], state [B, H, K, V]. Returns (o [B, H, T, V], state).

    The recurrence ``S_t = exp(g_t) S_{t-1} + k_t beta_t (v_t - exp(g_t) S_{t-1}^T k_t)^T``,
    ``o_t = S_t^T q_t``, taken ``chunk`` steps at a time as fla does: within a chunk the
    updates ``d = u - w S_0`` solve one unit lower-triangular system (the WY form), then
    outputs and the next state follow from ``S_0`` and ``d`` with cumulative decays."""
    length = q.shape[2]
    pad = -length % chunk
    if pad:
        # padded steps: k = 0, beta = 0, g = 0 leave the state alone and output nothing used
        q, k, v = (torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = (torch.nn.functional.pad(t, (0, pad)) for t in (g, beta))
    b, h, t_pad, dk = k.shape
    dv = v.shape[-1]
    n = t_pad // chunk
    q, k, v = (t.reshape(b, h, n, chunk, t.shape[-1]) for t in (q, k, v))
    g, beta = (t.reshape(b, h, n, chunk) for t in (g, beta))

    gc = g.cumsum(dim=-1)  # log of the decay from the chunk start through step i
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    strict = lower.clone().fill_diagonal_(False)
    # exp(gc_i - gc_j) for j <= i only (the other entries could overflow and are unused)
    diff = (gc.unsqueeze(-1) - gc.unsqueeze(-2)).masked_fill(~lower, float("-inf"))
    decay = diff.exp()
    k_beta = k * beta.unsqueeze(-1)
    system = (k_beta @ k.transpose(-1, -2) * decay).masked_fill(~strict, 0)
    system = system + torch.eye(chunk, dtype=q.dtype, device=q.device)
    w = torch.linalg.solve_triangular(
        system, k_beta * gc.exp().unsqueeze(-1), upper=False, unitriangular=True
    )
    u = torch.linalg.solve_triangular(
        system, v * beta.unsqueeze(-1), upper=False, unitriangular=True
    )
    scores = (q @ k.transpose(-1, -2) * decay).masked_fill(~lower, 0)
    q_decayed = q * gc.exp().unsqueeze(-1)
    k_to_end = k * (gc[..., -1:] - gc).exp().unsqueeze(-1)

    outs = []
    for i in range(n):
        delta = u[:, :, i] - w[:, :, i] @ state
        outs.append(q_decayed[:, :, i] @ state + scores[:, :, i] @ delta)
        state = state * gc[:, :, i, -1, None, None].exp() + k_to_end[:, :, i].transpose(
            -1, -2
        ) @ delta
    o = torch.stack(outs, dim=2).reshape(b, h, t_pad, dv)[:, :, :length]
    return o, state


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    cu_seqlens_cpu: torch.LongTensor | None = None,
    chunk_indices: torch.LongTensor | None = None,
    cp_context: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fla 0.6's ``chunk_gated_delta_rule`` (q, k [B, T, H, K], v [B, T, HV, V], g = log decay
    and beta [B, T, HV]; HV a multiple of H). Returns ``o`` [B, T, HV, V] in ``q``'s dtype and
    the final state [N, HV, K, V] in fp32 (``[N, HV, V, K]`` with ``state_v_first``) or None."""
    _unsupported("cp_context", cp_context, "fla's context parallelism")
    chunk = int(kwargs.pop("chunk_size", CHUNK_SIZE))
    if chunk not in (16, 32, 64):
        raise ValueError(f"chunk_size must be 16, 32 or 64 (fla's rule), got {chunk}")
    if q.shape[2] != k.shape[2] or v.shape[2] % q.shape[2]:
        raise ValueError(f"heads: q {q.shape[2]}, k {k.shape[2]}, v {v.shape[2]} (HV % H == 0)")
    dtype = _compute_dtype(q, k, v, g, beta)
    if scale is None:
        scale = k.shape[-1] ** -0.5
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q, output_dtype=dtype), l2norm(k, output_dtype=dtype)
    if use_beta_sigmoid_in_kernel:
        beta = torch.sigmoid(beta.to(dtype)) * (2.0 if allow_neg_eigval else 1.0)
    groups = v.shape[2] // q.shape[2]
    # head-first, compute dtype; q and k repeated per value head (fla's grouped value attention)
    qf, kf = (t.to(dtype).repeat_interleave(groups, dim=2).transpose(1, 2) for t in (q, k))
    vf, gf, bf = (t.to(dtype).transpose(1, 2) for t in (v, g, beta))
    qf = qf * scale

    if cu_seqlens is None:
        bounds = [(slice(None), 0, q.shape[1])]
        sequences = q.shape[0]
    else:
        if q.shape[0] != 1:
            raise ValueError("chunk_gated_delta_rule: cu_seqlens needs batch size 1")
        edges = [int(e) for e in cu_seqlens.tolist()]
        bounds = [(slice(0, 1), s, e) for s, e in zip(edges[:-1], edges[1:], strict=True)]
        sequences = len(bounds)
    heads, dk, dv = vf.shape[1], kf.shape[-1], vf.shape[-1]
    if initial_state is None:
        states = torch.zeros(sequences, heads, dk, dv, dtype=dtype, device=q.device)
    else:
        states = initial_state.to(dtype)
        if state_v_first:
            states = states.transpose(-1, -2)

    outs, finals = [], []
    for index, (rows, start, end) in enumerate(bounds):
        state0 = states if cu_seqlens is None else states[index : index + 1]
        o, final = _gated_delta_chunks(
            qf[rows, :, start:end],
            kf[rows, :, start:end],
            vf[rows, :, start:end],
            gf[rows, :, start:end],
            bf[rows, :, start:end],
            state0,
            chunk,
        )
        outs.append(o)
        finals.append(final)
    o = torch.cat(outs, dim=2).transpose(1, 2).to(q.dtype)
    if not output_final_state:
        return o, None
    final = torch.cat(finals, dim=0)
    if state_v_first:
        final = final.transpose(-1, -2)
    return o, final.to(torch.float64 if dtype == torch.float64 else torch.float32)


# --------------------------------------------------------------------------------- install


def _kernel_for_cuda(kernel: Callable[..., Any] | None, reference: Callable[..., Any]) -> Any:
    """``reference``, handing CUDA inputs to fla's ``kernel`` when it imported."""
    if kernel is None:
        return reference

    @functools.wraps(reference)
    def dispatch(*args: Any, **kwargs: Any) -> Any:
        first = args[0] if args else next(iter(kwargs.values()))  # x / q, maybe by keyword
        if first.is_cuda:
            return kernel(*args, **kwargs)
        return reference(*args, **kwargs)

    dispatch.fla_kernel = kernel  # type: ignore[attr-defined]
    return dispatch


def install_into_megatron() -> Callable[[], None]:
    """Put the references where megatron's Gated DeltaNet looks fla's kernels up (its
    ``common`` module, and ``gdn``, which imported two of them by name) and mark fla present
    (``HAVE_FLA``: the layer refuses to build without it). Returns the undo function."""
    from megatron.core.ssm.gated_delta_net import common, gdn

    from nemo_lw_fp8.cpu.megatron.swap import swap_attrs

    names = ("causal_conv1d", "l2norm", "chunk_gated_delta_rule")
    kernels = {name: getattr(common, name) for name in names}
    funcs = {name: _kernel_for_cuda(kernels[name], globals()[name]) for name in names}
    undo_common = swap_attrs(common, {**funcs, "HAVE_FLA": True})
    undo_gdn = swap_attrs(
        gdn, {name: funcs[name] for name in ("causal_conv1d", "chunk_gated_delta_rule")}
    )

    def undo() -> None:
        undo_gdn()
        undo_common()

    return undo
