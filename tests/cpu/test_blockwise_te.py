"""Blockwise FP8 emulation under TE 2.20.2's own classes, and against TE's real kernels.

TE's own classes run in a subprocess with the CPU backend active (as in test_te_backend.py), so
this process never imports TE or fixes megatron-core's TE flags. On a Hopper or Blackwell GPU
with real Transformer Engine, the emulation is compared with TE's kernels (``-m gpu``).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from nemo_lw_fp8.cpu.formats import blockwise as bw
from nemo_lw_fp8.cpu.formats import blockwise_sharded_cast as bws
from nemo_lw_fp8.cpu.te import backend as te_backend
from tests.support.blockwise_reference import wide, with_specials
from tests.support.fp8_reference import E4M3, E5M2
from tests.support.te_test_support import needs_te, te_script_results

# --------------------------------------------------------------------------------------------
# TE 2.20.2's own classes over the emulated extension (subprocess)
# --------------------------------------------------------------------------------------------


TE_SCRIPT = r"""
import json, math, random, threading
import torch
from nemo_lw_fp8.cpu.te import activate
R = {"backend": activate()}
import transformer_engine_torch as tex
from transformer_engine.common.recipe import Float8BlockScaling, Format
from transformer_engine.pytorch.quantization import Float8BlockScalingRecipeState
from transformer_engine.pytorch.tensor.float8_blockwise_tensor import (
    Float8BlockQuantizer, Float8BlockwiseQTensor)
from transformer_engine.pytorch.tensor.storage.float8_blockwise_tensor_storage import (
    Float8BlockwiseQTensorStorage)
from transformer_engine.pytorch.tensor.utils import (
    cast_master_weights_to_fp8, post_all_gather_processing, quantize_master_weights)
from nemo_lw_fp8.cpu.formats import blockwise as bw
import megatron.core.fp8_utils as fu

FMTS = {"e4m3": (torch.float8_e4m3fn, tex.DType.kFloat8E4M3),
        "e5m2": (torch.float8_e5m2, tex.DType.kFloat8E5M2)}

def same(a, b):
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))

# --- which blocks the recipe uses where
state = Float8BlockScalingRecipeState(Float8BlockScaling(), mode="forward", num_quantizers=3,
                                      device=torch.device("cpu"))
R["fwd_block_dims"] = [q.block_scaling_dim for q in state.make_quantizers()]
R["fwd_pow2"] = [q.force_pow_2_scales for q in state.make_quantizers()]
state = Float8BlockScalingRecipeState(Float8BlockScaling(fp8_format=Format.HYBRID),
                                      mode="backward", num_quantizers=2,
                                      device=torch.device("cpu"))
R["bwd_block_dims"] = [q.block_scaling_dim for q in state.make_quantizers()]
R["bwd_dtypes"] = [int(q.dtype) for q in state.make_quantizers()]

# --- bytes of TE's tensors == the emulation's, in every quantizer setting
mismatch = []
torch.manual_seed(0)
shapes = [(256, 384), (200, 300), (2, 96, 260)]
for shape in shapes:
    base = (torch.randn(shape) * torch.exp2(torch.randint(-10, 10, shape).float())).bfloat16()
    base.view(-1)[11] = float("nan")
    for fmt_name, (fmt, te_fmt) in FMTS.items():
        for bd in (1, 2):
            for usage in ((True, True), (True, False), (False, True)):
                for pow2, eps in ((True, 0.0), (False, 0.0), (True, 1e-2)):
                    key = f"{shape} {fmt_name} {bd}D {usage} pow2={pow2} eps={eps}"
                    q = Float8BlockQuantizer(te_fmt, rowwise=usage[0], columnwise=usage[1],
                                             block_scaling_dim=bd, force_pow_2_scales=pow2,
                                             amax_epsilon=eps)
                    for name, want in (("row", q.get_scale_shape(shape, False)),
                                       ("col", q.get_scale_shape(shape, True))):
                        got = (bw.rowwise_scale_shape if name == "row"
                               else bw.columnwise_scale_shape)(shape, bd)
                        if tuple(want) != tuple(got):
                            mismatch.append(f"{key} {name} scale shape {want} != {got}")
                    if tuple(q.get_columnwise_shape(shape)) != bw.columnwise_data_shape(shape):
                        mismatch.append(f"{key} columnwise shape")
                    t = q(base)
                    ref = bw.quantize(base, fmt, block_dim=bd, rowwise=usage[0],
                                      columnwise=usage[1], force_pow_2_scales=pow2,
                                      amax_epsilon=eps)
                    if not isinstance(t, Float8BlockwiseQTensor) or t._is_2D_scaled != (bd == 2):
                        mismatch.append(f"{key} type")
                    for n in ("rowwise_data", "rowwise_scale_inv", "columnwise_data",
                              "columnwise_scale_inv"):
                        if not same(getattr(t, "_" + n), getattr(ref, n)):
                            mismatch.append(f"{key} {n}")
                    got = t.dequantize(dtype=torch.float32)
                    want = bw.dequantize(ref, torch.float32)
                    if not torch.equal(got.nan_to_num(), want.nan_to_num()):
                        mismatch.append(f"{key} dequantize")
R["quantize_mismatches"] = mismatch

x = torch.randn(256, 384).bfloat16()
y = torch.randn(256, 384).bfloat16()
# columnwise-only dequantize (transposed data) in TE's Python == emulation
for bd in (1, 2):
    t = Float8BlockQuantizer(tex.DType.kFloat8E4M3, rowwise=True, columnwise=True,
                             block_scaling_dim=bd)(x)
    t.update_usage(rowwise_usage=False)
    R[f"dequant_columnwise_{bd}d"] = torch.equal(
        t.dequantize(), bw.dequantize(bw.quantize(x, block_dim=bd), use="columnwise"))

# megatron-core sees an FP8 (quantized) parameter, not an MXFP8 one
q = Float8BlockQuantizer(tex.DType.kFloat8E4M3, rowwise=True, columnwise=True)
p = torch.nn.Parameter(q(x), requires_grad=False)
R["megatron"] = [fu.HAVE_TE, fu.HAVE_TE_FP8_TENSOR_CLASS, fu.is_float8tensor(p),
                 fu.is_mxfp8tensor(p), isinstance(p, Float8BlockwiseQTensor)]
try:
    from megatron.core.distributed.fsdp.src.megatron_fsdp.mixed_precision import (
        is_blockwise_float8tensor)
    R["megatron_fsdp_blockwise"] = bool(is_blockwise_float8tensor(p))
except ImportError as exc:
    R["megatron_fsdp_blockwise"] = repr(exc)

# internal quantizer -> storage class; in-place paths; noop; derived columnwise
q = Float8BlockQuantizer(tex.DType.kFloat8E4M3, rowwise=True, columnwise=True)
q.internal = True
R["internal_type"] = type(q(x)).__name__
t = Float8BlockQuantizer(tex.DType.kFloat8E4M3, rowwise=True, columnwise=True)(x)
keep = t._rowwise_data.data_ptr()
t.quantize_(y)
ry = bw.quantize(y)
R["quantize_inplace"] = [torch.equal(t._rowwise_data, ry.rowwise_data),
                         torch.equal(t._columnwise_data, ry.columnwise_data),
                         torch.equal(t._rowwise_scale_inv, ry.rowwise_scale_inv),
                         t._rowwise_data.data_ptr() == keep]
t.copy_(x)
R["copy_from_plain"] = torch.equal(t._rowwise_data, bw.quantize(x).rowwise_data)
before = t._rowwise_data.clone()
tex.quantize(y, t._quantizer, t, torch.ones(1))
R["noop_flag"] = torch.equal(t._rowwise_data, before)
t.update_usage(rowwise_usage=True, columnwise_usage=False)
t.update_usage(rowwise_usage=True, columnwise_usage=True)  # _create_columnwise: fp8_transpose
rx = bw.quantize(x)
R["create_columnwise"] = [torch.equal(t._columnwise_data, rx.columnwise_data),
                          torch.equal(t._columnwise_scale_inv[:3, :2],
                                      rx.columnwise_scale_inv[:3, :2])]

# --- TE's quantize_master_weights with simulated ranks (threads + MAX all-reduce)
from tests.support.te_test_support import ThreadedMaxAllReduce as MaxOverThreads

class ThreadedMaxAllReduce(MaxOverThreads):
    # torch.distributed.all_reduce's signature; the buffers emptied for the next call
    def __call__(self, tensor, op=None, group=None, async_op=False):
        super().__call__(tensor)
        self.barrier.wait()
        with self.lock:
            self.buffers.clear()

def no_all_reduce(tensor, op=None, group=None, async_op=False):
    pass  # the control's mutation: each rank keeps the amaxes of its own shard

dist, dist_control = [], []
rng = random.Random(5)
for world, api, control in ((2, quantize_master_weights, False),
                            (4, cast_master_weights_to_fp8, False),
                            (4, quantize_master_weights, False),
                            (2, quantize_master_weights, True)):
    wshapes = [(256, 384), (200, 300), (128, 128)]
    masters = [torch.randn(s) * 3 for s in wshapes]
    full = [bw.quantize(m.bfloat16()) for m in masters]
    torch.distributed.all_reduce = no_all_reduce if control else ThreadedMaxAllReduce(world)
    make = lambda s: Float8BlockQuantizer(tex.DType.kFloat8E4M3, rowwise=True,
                                          columnwise=True)(torch.zeros(s, dtype=torch.bfloat16))
    models = [[make(s) for s in wshapes] for _ in range(world)]
    cuts = [[0, *sorted(rng.randrange(m.numel() + 1) for _ in range(world - 1)), m.numel()]
            for m in masters]
    errors = []
    def rank(r):
        try:
            shards, offsets = [], []
            for i, m in enumerate(masters):
                a, b = cuts[i][r], cuts[i][r + 1]
                shards.append(m.reshape(-1)[a:b] if b > a else None)
                offsets.append(a)
            api(models[r], shards, offsets, group=None)
        except BaseException as exc:
            errors.append(repr(exc)); raise
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    [th.start() for th in threads]; [th.join() for th in threads]
    ok = not errors
    for i, shape in enumerate(wshapes):
        h, w = bw.valid_scale_shape(shape)
        gathered = torch.cat([models[r][i]._rowwise_data.reshape(-1)[cuts[i][r]:cuts[i][r + 1]]
                              for r in range(world)])
        ok &= torch.equal(gathered, full[i].rowwise_data.reshape(-1))
        for r in range(world):
            s = models[r][i]._rowwise_scale_inv
            ok &= torch.equal(s[:h, :w], full[i].rowwise_scale_inv[:h, :w])
            ok &= bool((s[:, w:] == 1.0).all())
            ok &= models[r][i]._columnwise_data is None  # dropped until after the gather
        # the all-gather, then TE's post-processing derives the columnwise form locally
        weight = models[0][i]
        weight._rowwise_data.copy_(gathered.view(shape))
        post_all_gather_processing([weight])
        ok &= torch.equal(weight._columnwise_data, full[i].columnwise_data)
        ok &= torch.equal(weight._columnwise_scale_inv[:w, :h],
                          full[i].columnwise_scale_inv[:w, :h])
    (dist_control if control else dist).append([world, api.__name__, bool(ok), errors])
R["distributed"] = dist
R["distributed_control"] = dist_control

# --- megatron's attributes on a quantized weight survive a module-wide cast (Float16Module's
# module.bfloat16()), as TE's TransformerEngineBaseModule._apply keeps them; the control puts
# torch's own Module._apply back, whose swap_tensors drops them
from nemo_lw_fp8.cpu.layers.blockwise_linear import BlockwiseFP8Linear
from nemo_lw_fp8.cpu.layers.mxfp8_linear import MXFP8Linear, QuantizedParamModule
from transformer_engine.pytorch.module.base import TransformerEngineBaseModule
kept = {}
for cls in (BlockwiseFP8Linear, MXFP8Linear):
    for cast in ("module", "torch"):
        layer = cls(128, 64, bias=False, fp8_params=True)
        param = layer.weight
        param.allreduce = False
        keeping = QuantizedParamModule._apply
        if cast == "torch":
            QuantizedParamModule._apply = torch.nn.Module._apply
        try:
            layer.bfloat16()
        finally:
            QuantizedParamModule._apply = keeping
        kept[f"{cls.__name__} {cast}"] = [layer.weight is param,
                                          getattr(layer.weight, "allreduce", None)]
R["cast_keeps_attributes"] = kept
R["te_module_has_apply"] = "_apply" in vars(TransformerEngineBaseModule)
print("RESULT " + json.dumps(R))
"""


@pytest.fixture(scope="module")
def te_results() -> dict:
    return te_script_results(TE_SCRIPT)


@needs_te
def test_recipe_uses_128x128_for_weights_and_1x128_elsewhere(te_results):
    r = te_results
    assert r["backend"] == "emulated"
    assert r["fwd_block_dims"] == [1, 2, 1]  # input, weight, output
    assert r["fwd_pow2"] == [True, True, True]
    assert r["bwd_block_dims"] == [1, 1]  # grad_output, grad_input
    assert r["bwd_dtypes"] == [8, 8]  # HYBRID: e5m2 gradients


@needs_te
def test_te_quantizer_bytes_equal_emulation(te_results):
    r = te_results
    assert r["quantize_mismatches"] == []
    assert r["dequant_columnwise_1d"] and r["dequant_columnwise_2d"]
    assert r["internal_type"] == "Float8BlockwiseQTensorStorage"
    assert r["quantize_inplace"] == [True, True, True, True]
    assert r["copy_from_plain"] and r["noop_flag"]
    assert r["create_columnwise"] == [True, True]


@needs_te
def test_megatron_recognises_blockwise_parameter(te_results):
    have_te, have_class, is_fp8, is_mxfp8, is_blockwise = te_results["megatron"]
    assert have_te and have_class and is_fp8 and is_blockwise
    assert is_mxfp8 is False
    assert te_results["megatron_fsdp_blockwise"] is True


@needs_te
def test_module_cast_keeps_megatron_attributes_of_quantized_weights(te_results):
    """Issue 14: expert weights that lost ``allreduce=False`` in the Float16Module cast were
    reduced and sharded as dense ones (Hopper twins, FP8 param gather on != off)."""
    assert te_results["te_module_has_apply"]  # the TE behaviour emulated
    kept = te_results["cast_keeps_attributes"]
    for name in ("BlockwiseFP8Linear", "MXFP8Linear"):
        assert kept[f"{name} module"] == [True, False]
        assert kept[f"{name} torch"] == [True, None]  # control: torch's swap drops it


@needs_te
def test_te_quantize_master_weights_shards(te_results):
    for world, api, ok, errors in te_results["distributed"]:
        assert ok and not errors, (world, api, errors)


@needs_te
def test_control_te_quantize_master_weights_without_the_all_reduce_differs(te_results):
    """Control of ``test_te_quantize_master_weights_shards``: TE's ``quantize_master_weights``
    on 2 simulated ranks whose amax all-reduce does nothing (each rank scales its shard by the
    amaxes of that shard alone) completes, and the same checks fail."""
    [(world, api, ok, errors)] = te_results["distributed_control"]
    assert (world, api, errors) == (2, "quantize_master_weights", [])
    assert ok is False


# --------------------------------------------------------------------------------------------
# Hopper / Blackwell: the emulation against TE's real kernels
# --------------------------------------------------------------------------------------------


def _te_gpu_reason() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (9, 0):
        return f"TE's blockwise FP8 needs compute capability >= 9.0, this GPU is {major}.{minor}"
    if not te_backend._extension_file_present():
        return "real Transformer Engine (transformer-engine[pytorch]) is not installed"
    return None


@pytest.mark.gpu
def test_emulation_matches_te_kernels_on_gpu():
    reason = _te_gpu_reason()
    if reason is not None:
        pytest.skip(reason)
    assert te_backend.activate() == "transformer_engine"
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.optimizers.multi_tensor_apply import multi_tensor_applier
    from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockQuantizer

    te_fmt = {E4M3: tex.DType.kFloat8E4M3, E5M2: tex.DType.kFloat8E5M2}
    cases = [wide((256, 512), 0), wide((4096, 1024), 1), wide((200, 300), 2)]
    cases += [wide((2, 96, 260), 3), with_specials(wide((384, 256), 4))]
    cases += [with_specials(wide((256, 384), 5, torch.float32))]
    cases += [with_specials(wide((256, 256), 6, torch.float16))]
    failures = []
    for x in cases:
        for fmt, block_dim, pow2, eps in itertools.product(
            (E4M3, E5M2), (1, 2), (True, False), (0.0, 1e-3)
        ):
            key = f"{tuple(x.shape)} {x.dtype} {fmt} {block_dim}D pow2={pow2} eps={eps}"
            q = Float8BlockQuantizer(
                te_fmt[fmt],
                rowwise=True,
                columnwise=True,
                block_scaling_dim=block_dim,
                force_pow_2_scales=pow2,
                amax_epsilon=eps,
            )
            t = q(x.cuda())
            ref = bw.quantize(
                x, fmt, block_dim=block_dim, force_pow_2_scales=pow2, amax_epsilon=eps
            )
            for direction in ("rowwise", "columnwise"):
                got = getattr(t, f"_{direction}_data").cpu()
                if not torch.equal(got, getattr(ref, f"{direction}_data")):
                    failures.append(f"{key} {direction}_data")
                h, w = bw.valid_scale_shape(x.shape, block_dim, direction == "columnwise")
                got = getattr(t, f"_{direction}_scale_inv").cpu()[:h, :w]
                if not torch.equal(got, getattr(ref, f"{direction}_scale_inv")[:h, :w]):
                    failures.append(f"{key} {direction}_scale_inv")
            deq = t.dequantize(dtype=torch.float32).cpu()
            if not torch.equal(deq.nan_to_num(), bw.dequantize(ref, torch.float32).nan_to_num()):
                failures.append(f"{key} dequantize")

    # fp8_transpose and the distributed-optimizer kernels
    x = with_specials(wide((384, 300), 8, torch.float32)).bfloat16()
    rowwise = bw.quantize(x).rowwise_data
    transposed = tex.fp8_transpose(rowwise.cuda(), tex.DType.kFloat8E4M3, out=None)
    if not torch.equal(transposed.cpu(), rowwise.t().contiguous()):
        failures.append("fp8_transpose")
    shape, start, n = (384, 300), 12345, 50000
    shard = x.reshape(-1)[start : start + n].contiguous()
    amax = torch.zeros(bw.rowwise_scale_shape(shape), dtype=torch.float32, device="cuda")
    tex.fp8_block_scaling_compute_partial_amax(shard.cuda(), amax, *shape, start, 128)
    want_amax = bws.compute_partial_amax(shard, shape, start)
    if not torch.equal(amax.cpu(), want_amax):
        failures.append("partial amax")
    for pow2 in (True, False):
        scale, scale_inv = torch.empty_like(amax), torch.empty_like(amax)
        multi_tensor_applier(
            tex.multi_tensor_compute_scale_and_scale_inv,
            torch.zeros(1, dtype=torch.int, device="cuda"),
            [[amax], [scale], [scale_inv]],
            448.0,
            pow2,
            0.0,
        )
        want = bw.compute_scale(want_amax, E4M3, pow2, 0.0, bw.FLT_MAX)
        if not (
            torch.equal(scale.cpu(), want)
            and torch.equal(scale_inv.cpu(), bw.scale_inv_from_scale(want))
        ):
            failures.append(f"compute_scale_and_scale_inv pow2={pow2}")
        out = torch.zeros(x.numel(), dtype=torch.uint8, device="cuda")
        fragment = out[start : start + n]
        tex.fp8_block_scaling_partial_cast(
            shard.cuda(), fragment, scale, *shape, start, 128, tex.DType.kFloat8E4M3
        )
        if not torch.equal(fragment.cpu(), bws.partial_cast(shard, want, shape, start)):
            failures.append(f"partial cast pow2={pow2}")
    assert failures == []
