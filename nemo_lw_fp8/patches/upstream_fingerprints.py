"""Recorded by ``python -m nemo_lw_fp8.patches.fingerprints --write`` (do not edit):
per tested version, per patch, each wrapped upstream object's source fingerprint.
tests/patches/test_patch_framework.py checks this record against the installed stack.
"""

#: megatron-core 0.19.0, megatron-core 0.19.2: the same record.
_MEGATRON_CORE_0_19_0: dict[str, dict[str, str]] = {
    'blockwise_fp8_param_gather': {
        'StepTable.blockwise_fp8_param_gather':
            'absent',
        'megatron.core.distributed.distributed_data_parallel.partition_buckets':
            'e8318725b4a36c0d',
        'megatron.core.distributed.param_and_grad_buffer._ParamAndGradBucketGroup._post_param_sync':
            'eea386860345c88b',
        'megatron.core.distributed.param_and_grad_buffer._ParamAndGradBucketGroup.finish_param_sync':
            '2a5efb9825ec2c62',
        'megatron.core.distributed.param_and_grad_buffer._ParamAndGradBucketGroup.start_param_sync':
            '4f819373090bd530',
    },
    'compact_layout': {
        'StepTable.compact_layout':
            'absent',
        'megatron.core.distributed.distributed_data_parallel.partition_buckets':
            'e8318725b4a36c0d',
        'megatron.core.distributed.param_and_grad_buffer._ParamAndGradBucketGroup.finish_param_sync':
            '2a5efb9825ec2c62',
        'megatron.core.distributed.param_and_grad_buffer._ParamAndGradBucketGroup.start_grad_sync':
            '62f8f12d579769ef',
        'megatron.core.distributed.param_and_grad_buffer._ParamAndGradBucketGroup.start_param_sync':
            '4f819373090bd530',
        'megatron.core.distributed.param_and_grad_buffer._ParamAndGradBuffer.__init__':
            '38d0b3c383c1ce6f',
        'megatron.core.optimizer.layer_wise_optimizer.LayerWiseDistributedOptimizer.compute_full_param_layout':
            '0493dd9818b4b185',
        'megatron.core.optimizer.layer_wise_optimizer.LayerWiseDistributedOptimizer.shard_params':
            'a3fb36ccc55ba9f6',
        'megatron.core.optimizer.layer_wise_optimizer.LayerWiseDistributedOptimizer.sharded_state_dict':
            '12b2397eb4e0708c',
    },
    'grouped_weight_layerwise': {
        'EmergingOptimizerEntry.default_param_overrides':
            '3718e1544494c65e',
        'megatron.core.optimizer.emerging_optimizers.TensorParallelMuon.orthogonalize':
            '6949fd0b737c147a',
        'megatron.core.optimizer.emerging_optimizers._is_nonlinear_or_embedding':
            'c236984cd03ba4a0',
        'megatron.core.optimizer.is_managed_by_layer_wise_optimizer':
            'd1a7a580b3379c80',
        'megatron.core.optimizer.layer_wise_optimizer.is_managed_by_layer_wise_optimizer':
            'd1a7a580b3379c80',
    },
    'layer_wise_init': {
        'megatron.core.optimizer.layer_wise_optimizer.LayerWiseDistributedOptimizer.__init__':
            '62e62fc6b530e656',
    },
    'layer_wise_load_rederive': {
        'megatron.core.optimizer.layer_wise_optimizer.LayerWiseDistributedOptimizer.load_state_dict':
            'a9eb2538e1680d8e',
    },
    'mla_local_attention': {
        'megatron.core.transformer.dot_product_attention.DotProductAttention.__init__':
            '1081aca9a2f35290',
    },
    'muon_fp8_param_gather': {
        'StepTable.muon_fp8_param_gather':
            'absent',
        'megatron.core.optimizer.distrib_optimizer.DistributedOptimizer.start_param_sync_for_bucket_group_subset':
            '15960c4e9c550ad3',
        'megatron.core.optimizer.layer_wise_optimizer.LayerWiseDistributedOptimizer._copy_main_params_to_param_buffer':
            'absent',
        'megatron.core.optimizer.layer_wise_optimizer.LayerWiseDistributedOptimizer.prepare_model_params_for_param_sync':
            'absent',
        'megatron.core.optimizer.layer_wise_optimizer.LayerWiseDistributedOptimizer.start_param_sync_for_bucket_group_subset':
            'd17dc4129ed8253e',
        'megatron.core.optimizer.layer_wise_optimizer.LayerWiseDistributedOptimizer.step_with_ready_grads':
            '0520cb352a3fa417',
        'megatron.core.optimizer.optimizer.ChainedOptimizer._enable_deferred_mxfp8_param_sync':
            'f60c0c6ae32c42e6',
        'megatron.training.arguments.validate_args':
            '47bfcd3af0d8687f',
    },
    'restage_forced_sync': {
        'megatron.core.distributed.distributed_data_parallel.DistributedDataParallel.forward':
            'absent',
        'megatron.core.distributed.distributed_data_parallel.DistributedDataParallel.start_param_sync':
            '28173a152b26f4ee',
        'megatron.core.distributed.distributed_data_parallel.DistributedDataParallel.zero_grad_buffer':
            '6bbd2a84649f6c87',
        'megatron.core.optimizer.distrib_optimizer.DistributedOptimizer._copy_main_params_to_param_buffer':
            'c7b8e49b5285b3b9',
        'megatron.core.optimizer.distrib_optimizer.DistributedOptimizer.step_with_ready_grads':
            '2350cce9dd8822dd',
        'megatron.core.optimizer.optimizer.ChainedOptimizer.prepare_model_params_for_param_sync':
            'f24684fc78e22cff',
    },
    'te_grouped_checkpoint': {
        'megatron.core.extensions.transformer_engine.TEGroupedLinear._sharded_state_dict_grouped':
            '77510958bcfa2582',
        'megatron.core.transformer.moe.experts.TEGroupedMLP.sharded_state_dict':
            'ab4db82cc4cafb98',
    },
}

FINGERPRINTS: dict[str, dict[str, dict[str, str]]] = {
    'megatron-bridge 0.6.2': {
        'bridge_checkpoint_compat': {
            'megatron.bridge.training.checkpointing._load_checkpoint_from_path':
                '6ea5d3ebb6b4de01',
            'megatron.bridge.training.checkpointing.read_run_config':
                'bfe99d25267b9099',
        },
        'bridge_checkpoint_rng': {
            'megatron.bridge.training.checkpointing.get_rng_state':
                'e11b8e012c94cd34',
        },
        'bridge_checkpoint_sharding': {
            'megatron.bridge.training.checkpointing._build_sharded_state_dict_metadata':
                '7708cba49fa62878',
            'megatron.bridge.training.checkpointing.save_checkpoint':
                '901f55a32884c5e7',
        },
        'bridge_config_guards': {
            'megatron.bridge.training.config.ConfigContainer.validate':
                'b8dd45792a4931ae',
        },
        'bridge_layer_wise_wrap': {
            'megatron.bridge.models.model_provider._ddp_wrap':
                '13b438c376603bcb',
        },
        'bridge_save_param_sync': {
            'megatron.bridge.training.train.save_checkpoint_and_time':
                '6a211f305b8102eb',
        },
    },
    'megatron-core 0.19.0': _MEGATRON_CORE_0_19_0,
    'megatron-core 0.19.2': _MEGATRON_CORE_0_19_0,
}
