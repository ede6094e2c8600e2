"""``torchrun`` target for tests/bridge/test_bridge_training.py: ``nemo-lw-fp8 pretrain`` with an
optional mutation (env ``NEMO_LW_FP8_TEST_MUTATION``) switching one plugin fix off, so the test
shows its parity check fails without that fix (also the target of
tests/bridge/test_bridge_checkpointing.py, tests/bridge/test_bridge_hopper.py and
tests/recipes/test_recipe_twins.py; env ``NEMO_LW_FP8_TEST_PROBE``: a path prefix where each
rank records what the layer-wise optimizer was built over)."""

from __future__ import annotations

import os
import sys


def install_mutation(mutation: str) -> None:
    """Switch one fix off in this process (before the ranks start, after imports is fine: the
    plugin looks these functions up on their modules when it calls them)."""
    if mutation == "masters_from_fp8":
        # Masters from the dequantized FP8 weights (stock layer-wise behaviour), not TE's init
        # values.
        import nemo_lw_fp8.mechanics.masters as masters

        masters.init_masters_from_high_precision = lambda optimizer: None
    elif mutation == "stage_before_hook_gather":
        # No staging before the gathers of an eval run with the pre-hooks on (stock behaviour).
        import nemo_lw_fp8.mechanics.staging as staging

        staging.stage_if_unstaged = lambda chunk: None
    elif mutation == "save_param_sync":
        # No forced param gather before a save of a layer-wise run (Bridge 0.6.2's behaviour).
        import nemo_lw_fp8.mechanics.checkpointing as checkpointing

        checkpointing.save_needs_param_sync = lambda cfg: False
    elif mutation == "blockwise_columnwise":
        # Receivers keep the columnwise copy of gathered blockwise weights as it was (the dgrad
        # GEMM then reads stale weights); the rowwise copy is still refreshed.
        import nemo_lw_fp8.mechanics.blockwise as blockwise

        blockwise.derive_columnwise = lambda params: None
    elif mutation in ("nvfp4_stale_amax", "nvfp4_stale_columnwise"):
        # Receivers of the FP4 param gather keep their old per-tensor amax (the GEMM's global
        # scale) or their old columnwise copy (dgrad and wgrad read it) after each gather.
        import nemo_lw_fp8.mechanics.nvfp4_gather as nvfp4_gather

        if mutation == "nvfp4_stale_amax":
            nvfp4_gather.write_amax = lambda param, amax: None
        else:
            nvfp4_gather.derive_columnwise = lambda param: None
    elif mutation == "te_stale_columnwise":
        # TE's modules: every re-quantization of a persistent MXFP8 weight (the gather's copy
        # into the weights) refreshes the rowwise copy only; the columnwise copy the dgrad GEMM
        # reads keeps its old bytes.
        from nemo_lw_fp8.cpu.te import backend as te_backend

        te_backend.activate()  # TE over the CPU emulation before anything imports it
        from te_helpers import rowwise_only_refresh  # tests/support/ is this script's path
        from transformer_engine.pytorch.tensor.mxfp8_tensor import MXFP8Quantizer

        MXFP8Quantizer.update_quantized = rowwise_only_refresh(MXFP8Quantizer.update_quantized)
    elif mutation == "nudge_loaded_master":
        # After a checkpoint load, each rank's first layer-wise fp32 master moves up by one ulp:
        # the state the run goes on from is then not the state that was saved.
        import math

        import torch

        import nemo_lw_fp8.patches.bridge_checkpoint_compat as compat

        def _leaves(optimizer):
            children = getattr(optimizer, "chained_optimizers", None)
            if children is None:
                yield optimizer
            for child in children or ():
                yield from _leaves(child)

        def _nudge_first_master(optimizer) -> None:
            for leaf in _leaves(optimizer):  # the layer-wise Muon wrappers hold these groups
                for group in getattr(leaf, "fp32_from_float16_groups", None) or []:
                    if group:
                        flat = group[0].data.view(-1)
                        flat[0] = torch.nextafter(flat[0], torch.tensor(math.inf))
                        return

        _make_load = compat._make_load

        def _nudging_make_load(original):
            def load(load_dir, state, model, optimizer, *args, **kwargs):
                loaded = original(load_dir, state, model, optimizer, *args, **kwargs)
                _nudge_first_master(optimizer)
                return loaded

            return _make_load(load)

        compat._make_load = _nudging_make_load
    elif mutation == "reduce_to_wrong_owner":
        # Each Muon gradient span is reduced to the next rank instead of its owner (the owner
        # then steps on its local, unreduced gradient).
        import torch.distributed as dist

        _reduce = dist.reduce

        def _shifted(tensor, *args, group=None, group_dst=None, **kwargs):
            if group is None or group_dst is None:
                return _reduce(tensor, *args, group=group, group_dst=group_dst, **kwargs)
            return _reduce(tensor, *args, group=group, group_dst=(group_dst + 1) % group.size(),
                           **kwargs)  # fmt: skip

        dist.reduce = _shifted
    elif mutation == "stale_eval_staging":
        # The staging before an eval's gathers (an optimizer stepped, nothing zeroed since)
        # writes the bf16 values this rank staged last (the masters before the step), not the
        # current masters: the eval reads the previous step's weights. Everything staged after a
        # zero_grad_buffer (the training forwards' gathers) is staged as usual.
        import torch

        import nemo_lw_fp8.mechanics.staging as staging
        from nemo_lw_fp8.mechanics import expert_slices, masters
        from nemo_lw_fp8.state import peek

        _stage_owned = staging.stage_owned_masters
        _stage_if_unstaged = staging.stage_if_unstaged
        last_staged: dict[int, list] = {}  # id(optimizer) -> [(bucket, start, end, values)]

        def _recording_stage(optimizer) -> None:
            _stage_owned(optimizer)
            slots, staged = staging._param_slots(optimizer), []
            for child in masters.float16_children(optimizer):
                for model_param, _ in masters.model_main_pairs(child):
                    if not expert_slices.uses_quantized_storage(model_param):
                        continue
                    if expert_slices.is_part_of_weight(model_param):
                        continue
                    bucket, start, end = slots[model_param]
                    if bucket.param_data is not None:
                        values = bucket.param_data.view(-1)[start:end].clone()
                        staged.append((bucket, start, end, values))
            last_staged[id(optimizer)] = staged

        @torch.no_grad()
        def _stale_stage_if_unstaged(chunk) -> None:
            record = peek(chunk)
            for optimizer in record.optimizers() if record is not None else ():
                stale = last_staged.get(id(optimizer))
                if not staging.is_unstaged(optimizer) or stale is None:
                    continue
                for bucket, start, end, values in stale:
                    bucket.param_data.view(-1)[start:end].copy_(values)
                for model_chunk in optimizer.model_chunks:
                    model_chunk.reset_param_sync_dispatch_state()
                staging.clear_unstaged(optimizer)
            _stage_if_unstaged(chunk)  # the optimizers left unstaged (none staged yet, DistOpt)

        staging.stage_owned_masters = _recording_stage
        staging.stage_if_unstaged = _stale_stage_if_unstaged
    elif mutation == "stale_own_expert_runs":
        # Each owner assembles its grouped MXFP8 expert weights with the gathered runs of the
        # other ranks but its own runs' current (pre-step, dequantized) values in place of the
        # bytes it stepped and sent: the other ranks take the stepped runs, the owner keeps its
        # old ones (finite values; the weights of the ranks then differ).
        import torch

        import nemo_lw_fp8.mechanics.compact_gather as compact_gather
        from nemo_lw_fp8.mechanics import expert_slices

        _unpack = compact_gather.unpack

        @torch.no_grad()
        def _unpack_keeping_own_runs(group, plan, gathered) -> None:
            rank = group.data_parallel_group.rank()
            offset = plan.segment_start(rank)
            for piece in plan.segments[rank]:
                if expert_slices.is_slice(piece) and piece.quantized_parent:
                    old = expert_slices.model_values(piece).reshape(-1)
                    gathered[offset : offset + piece.numel()].copy_(old)
                offset += piece.numel()
            _unpack(group, plan, gathered)

        compact_gather.unpack = _unpack_keeping_own_runs
    elif mutation == "tp_duplicated_partitioned":
        # The masters of TP-duplicated weights (MLA's down projections) keep the partition
        # dimension TE tagged them with: Muon gathers the identical copies over TP and
        # orthogonalizes the stack (megatron-core 0.19.2's behaviour).
        import nemo_lw_fp8.mechanics.tp_duplicated as tp_duplicated

        tp_duplicated.unpartition_duplicated_masters = lambda optimizer: []
    elif mutation == "masters_from_loaded_fp8":
        # A model-only load (checkpoint.pretrained_checkpoint) leaves the masters of FP8 weights
        # to megatron's reload_model_params, which copies the weights the load just quantized
        # (the behaviour before issue 46).
        import nemo_lw_fp8.mechanics.pretrained_load as pretrained_load

        pretrained_load.follow_model_loads = lambda optimizer: None
    elif mutation:
        raise SystemExit(f"unknown mutation {mutation!r}")


def install_probe(prefix: str) -> None:
    """Each rank writes ``{prefix}.rank<N>.json`` at the end of training: what the run really
    did, read off the ranks rather than the configuration.

    * ``fp8_weights``: the model parameters held as persistent FP8 tensors (MXFP8, blockwise,
      grouped), which only an FP8 param gather updates: > 0 proves the gather ON, 0 OFF;
    * ``te_modules`` / ``project_layers``: the model's modules of TE's classes / of the
      project's CPU layers (which path ``--cpu-modules`` built);
    * ``tp``, ``ep``, ``sequence_parallel``: megatron's tensor- and expert-parallel sizes on
      this rank and the model's sequence parallelism;
    * ``reduces``: the ``torch.distributed.reduce`` calls this rank issued (the owner reduce
      sends each Muon gradient span to its owner with one; the all-reduce sync issues none);
    * ``linears``, ``blockwise_weights``, ``blockwise_groups``: what the layer-wise optimizer of
      a blockwise run was built over (the emulated FP8 linears, persistent blockwise weights,
      blockwise gather plans); ``columnwise_derived``: the gathered blockwise weights whose
      columnwise copy a receiver derived (with the stale-columnwise mutation: the ones it
      would have);
    * ``mxfp8_requantized``: the re-quantizations into persistent MXFP8 weights that hold a
      columnwise copy (``MXFP8Quantizer.update_quantized``: the gathers' copy into TE's weights
      and grouped members), i.e. the copies the ``te_stale_columnwise`` mutation leaves stale;
    * ``nvfp4_weights``: the model parameters held as persistent ``NVFP4Tensor``s (NVFP4
      primary weights); ``nvfp4_unpacked``: the gathered NVFP4 weights a receiver rebuilt from
      FP4 bytes; ``gemms`` / ``nvfp4_gemms``: TE's ``generic_gemm`` calls during training and
      those whose first operand was NVFP4; ``te_bf16_matrices``: TE modules' 2-D weights held
      as plain tensors (bf16-kept layers beside NVFP4 primary weights);
    * ``tp_duplicated``: the layer-wise masters of weights duplicated over TP (MLA's down
      projections) whose TE partition dimension the optimizer build cleared;
      ``tp_duplicated_partitioned``: layer-wise masters not TP-sharded that still carry one at
      the end (Muon gathers those over TP).
    """
    if not prefix:
        return
    import json

    import torch.distributed as dist

    import nemo_lw_fp8.cli.pretrain as launch_pretrain
    import nemo_lw_fp8.mechanics.blockwise as blockwise
    import nemo_lw_fp8.mechanics.tp_duplicated as tp_duplicated
    from nemo_lw_fp8.mechanics import expert_slices

    _set_up, _attach = blockwise.set_up, blockwise.attach_groups
    _derive = blockwise.derive_columnwise
    _seen: dict = {"blockwise_groups": 0, "reduces": 0, "columnwise_derived": 0}

    def _counting_derive(params):
        _seen["columnwise_derived"] += sum(1 for p in params if blockwise.is_blockwise(p))
        return _derive(params)

    _reduce = dist.reduce

    def _counting_reduce(*args, **kwargs):
        _seen["reduces"] += 1
        return _reduce(*args, **kwargs)

    def _probe_attach(optimizer):
        _seen["blockwise_groups"] += _attach(optimizer)
        return _seen["blockwise_groups"]

    def _probe_set_up(optimizer):
        linears: dict = {}
        for chunk in optimizer.model_chunks:
            for module in chunk.module.modules():
                name = type(module).__name__
                if name.endswith("ParallelLinear"):
                    linears[name] = linears.get(name, 0) + 1
        _seen["linears"] = linears
        _seen["blockwise_weights"] = len(blockwise.layer_wise_blockwise_params(optimizer))
        _set_up(optimizer)

    _unpartition = tp_duplicated.unpartition_duplicated_masters  # after any mutation of it

    def _counting_unpartition(optimizer):
        changed = _unpartition(optimizer)
        _seen["tp_duplicated"] = _seen.get("tp_duplicated", 0) + len(changed)
        return changed

    import nemo_lw_fp8.cpu.megatron.bridge_pretrain as cpu_bridge
    import nemo_lw_fp8.mechanics.nvfp4_gather as nvfp4_gather

    _seen.update(nvfp4_unpacked=0, gemms=0, nvfp4_gemms=0, mxfp8_requantized=0)
    _unpack_nvfp4 = nvfp4_gather.unpack_param  # after any mutation of the module

    def _counting_unpack_nvfp4(param, payload):
        _seen["nvfp4_unpacked"] += 1
        return _unpack_nvfp4(param, payload)

    _device_answers = cpu_bridge.device_answers

    def _counting_device_answers(cfg, modules="te"):
        # Training starts inside this scope; TE (over the emulation) is imported by then.
        import transformer_engine_torch as tex

        if not getattr(tex.generic_gemm, "_probe", False):
            _gemm = tex.generic_gemm

            def _counting_gemm(a, *args, **kwargs):
                _seen["gemms"] += 1
                _seen["nvfp4_gemms"] += type(a).__name__.startswith("NVFP4")
                return _gemm(a, *args, **kwargs)

            _counting_gemm._probe = True
            tex.generic_gemm = _counting_gemm
        from transformer_engine.pytorch.tensor.mxfp8_tensor import MXFP8Quantizer

        if not getattr(MXFP8Quantizer.update_quantized, "_probe", False):
            _update = MXFP8Quantizer.update_quantized  # after any mutation of it

            def _counting_update(self, src, dst, *, noop_flag=None):
                _seen["mxfp8_requantized"] += getattr(dst, "_columnwise_data", None) is not None
                return _update(self, src, dst, noop_flag=noop_flag)

            _counting_update._probe = True
            MXFP8Quantizer.update_quantized = _counting_update
        return _device_answers(cfg, modules)

    nvfp4_gather.unpack_param = _counting_unpack_nvfp4
    cpu_bridge.device_answers = _counting_device_answers
    _digest = launch_pretrain.optimizer_state_digest

    def _probing_digest(optimizer):  # on_train_end, every rank
        _seen["fp8_weights"] = sum(
            1
            for chunk in optimizer.model_chunks
            for param in chunk.parameters()
            if expert_slices.uses_quantized_storage(param)
        )
        from megatron.core import parallel_state as ps

        # The parallel sizes megatron built this rank's groups with, and whether the model ran
        # sequence parallel (a twin's TP / EP as shipped, read off the rank).
        _seen["tp"] = ps.get_tensor_model_parallel_world_size()
        _seen["ep"] = ps.get_expert_model_parallel_world_size()
        _seen["sequence_parallel"] = optimizer.model_chunks[0].config.sequence_parallel
        from nemo_lw_fp8.mechanics import masters

        def _layer_wise(opt):  # the layer-wise optimizers under Bridge's chain
            if type(opt).__name__ == "LayerWiseDistributedOptimizer":
                yield opt
            for child in getattr(opt, "chained_optimizers", None) or ():
                yield from _layer_wise(child)

        _seen["tp_duplicated_partitioned"] = sum(
            tp_duplicated.is_mislabelled(main)
            for layer_wise in _layer_wise(optimizer)
            for child in masters.float16_children(layer_wise)
            for _, main in masters.model_main_pairs(child)
        )
        _seen["nvfp4_weights"] = sum(
            nvfp4_gather.is_nvfp4(param)
            for chunk in optimizer.model_chunks
            for param in chunk.parameters()
        )
        _seen["te_bf16_matrices"] = sum(
            param.dim() == 2 and not expert_slices.uses_quantized_storage(param)
            for chunk in optimizer.model_chunks
            for module in chunk.modules()
            # megatron's TE wrappers subclass TE's modules from megatron's own module
            if any(c.__module__.startswith("transformer_engine.") for c in type(module).__mro__)
            for param in module.parameters(recurse=False)
        )
        kinds = [type(m).__module__ for c in optimizer.model_chunks for m in c.modules()]
        _seen["te_modules"] = sum(k.startswith("transformer_engine.") for k in kinds)
        _seen["project_layers"] = sum(k.startswith("nemo_lw_fp8.cpu.") for k in kinds)
        with open(f"{prefix}.rank{os.environ.get('RANK', '0')}.json", "w") as handle:
            json.dump(_seen, handle)
        return _digest(optimizer)

    dist.reduce = _counting_reduce
    blockwise.set_up, blockwise.attach_groups = _probe_set_up, _probe_attach
    blockwise.derive_columnwise = _counting_derive
    tp_duplicated.unpartition_duplicated_masters = _counting_unpartition
    launch_pretrain.optimizer_state_digest = _probing_digest


def install_state_tensors(prefix: str) -> None:
    """Each rank also writes the tensors behind its per-parameter state record
    (:func:`nemo_lw_fp8.mechanics.state_by_name.state_by_name`, taken at the start and the end of
    training) to ``{prefix}.{start|end}.rank<N>.pt``: ``{"state": {name: {kind: tensor}},
    "partition_dim": {name: dim}}``, the second for every TP-sharded parameter (megatron's
    ``partition_dim`` attribute, names as the record gives them, TP rank included).

    Why: the record holds SHA-256 digests, which can be compared only where two runs hold the
    same tensors; the state of another TP size must first be put together from its shards
    (tests/support/tp_merge.py)."""
    if not prefix:
        return
    import torch

    import nemo_lw_fp8.mechanics.state_by_name as by_name

    _sha, _record = by_name._sha, by_name.state_by_name
    seen: dict = {}
    taken: list[str] = []

    def _keeping_sha(tensor):
        digest = _sha(tensor)
        seen[digest] = tensor.detach().cpu().clone()
        return digest

    def _recording(optimizer, model_chunks):
        seen.clear()
        record = _record(optimizer, model_chunks)
        names = by_name._Names(model_chunks).names
        dims = {
            names[id(param)]: int(param.partition_dim)
            for chunk in model_chunks
            for param in chunk.parameters()
            if getattr(param, "tensor_model_parallel", False) and "/tp" in names[id(param)]
        }
        state = {name: {k: seen[d] for k, d in kinds.items()} for name, kinds in record.items()}
        when = ("start", "end")[len(taken)]
        taken.append(when)
        rank = os.environ.get("RANK", "0")
        torch.save({"state": state, "partition_dim": dims}, f"{prefix}.{when}.rank{rank}.pt")
        return record

    by_name._sha = _keeping_sha
    by_name.state_by_name = _recording


install_mutation(os.environ.get("NEMO_LW_FP8_TEST_MUTATION", ""))
install_probe(os.environ.get("NEMO_LW_FP8_TEST_PROBE", ""))
install_state_tensors(os.environ.get("NEMO_LW_FP8_TEST_STATE_TENSORS", ""))

from nemo_lw_fp8 import cli  # noqa: E402

# Guarded: a checkpoint save starts a multiprocessing manager with the "spawn" method, whose
# child imports this file as __main__ again (unguarded, it re-ran the whole pretrain and hung).
if __name__ == "__main__":
    sys.exit(cli.main(sys.argv[1:]))
