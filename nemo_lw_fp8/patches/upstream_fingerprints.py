"""Recorded by ``python -m nemo_lw_fp8.patches.fingerprints --write`` (do not edit):
per tested version, per patch, its verdict and each wrapped object's fingerprint
(nemo_lw_fp8/patches/record.py). tests/patches/test_upstream_fingerprints.py checks
this record against the installed stack.
"""

#: megatron-core 0.19.0, megatron-core 0.19.2: the same record.
_MEGATRON_CORE_0_19_0: dict[str, dict[str, object]] = {
    'blockwise_fp8_param_gather': {
        'verdict': 'patched',
        'targets': {
            'StepTable.blockwise_fp8_param_gather':
                'absent',
            'megatron.core.distributed.distributed_data_parallel.partition_buckets':
                'd7678726be50a815',
            'megatron.core.distributed.param_and_grad_buffer._ParamAndGradBucketGroup._post_param_sync':
                '94df4bdab7023654',
            'megatron.core.distributed.param_and_grad_buffer._ParamAndGradBucketGroup.finish_param_sync':
                '7449ad5184a97a3d',
            'megatron.core.distributed.param_and_grad_buffer._ParamAndGradBucketGroup.start_param_sync':
                '1c5de736acc08df8',
        },
    },
    'compact_layout': {
        'verdict': 'patched',
        'targets': {
            'StepTable.compact_layout':
                'absent',
            'megatron.core.distributed.distributed_data_parallel.partition_buckets':
                'd7678726be50a815',
            'megatron.core.distributed.param_and_grad_buffer._ParamAndGradBucketGroup.finish_param_sync':
                '7449ad5184a97a3d',
            'megatron.core.distributed.param_and_grad_buffer._ParamAndGradBucketGroup.start_grad_sync':
                '29bbd6d8b1aa8e22',
            'megatron.core.distributed.param_and_grad_buffer._ParamAndGradBucketGroup.start_param_sync':
                '1c5de736acc08df8',
            'megatron.core.distributed.param_and_grad_buffer._ParamAndGradBuffer.__init__':
                '018b21a04fb7a76b',
            'megatron.core.optimizer.layer_wise_optimizer.LayerWiseDistributedOptimizer.compute_full_param_layout':
                'a7e051ef262d58d7',
            'megatron.core.optimizer.layer_wise_optimizer.LayerWiseDistributedOptimizer.shard_params':
                'bb95ba64498e0cad',
            'megatron.core.optimizer.layer_wise_optimizer.LayerWiseDistributedOptimizer.sharded_state_dict':
                '7e0eb43ccdd733ed',
        },
    },
    'grouped_weight_layerwise': {
        'verdict': 'patched',
        'targets': {
            'megatron.core.optimizer.emerging_optimizers.TensorParallelMuon.orthogonalize':
                '935648252eef5970',
            "megatron.core.optimizer.emerging_optimizers._EMERGING_OPTIMIZERS['adaptive_muon'].default_param_overrides":
                '6758f88509098255',
            "megatron.core.optimizer.emerging_optimizers._EMERGING_OPTIMIZERS['muon'].default_param_overrides":
                '6758f88509098255',
            'megatron.core.optimizer.emerging_optimizers._is_nonlinear_or_embedding':
                '3a10b0b405507187',
            'megatron.core.optimizer.is_managed_by_layer_wise_optimizer':
                '8004ebf7e4f26a86',
            'megatron.core.optimizer.layer_wise_optimizer.is_managed_by_layer_wise_optimizer':
                '8004ebf7e4f26a86',
        },
    },
    'layer_wise_init': {
        'verdict': 'patched',
        'targets': {
            'megatron.core.optimizer.layer_wise_optimizer.LayerWiseDistributedOptimizer.__init__':
                'd5274c71099d1a92',
        },
    },
    'layer_wise_load_rederive': {
        'verdict': 'patched',
        'targets': {
            'megatron.core.optimizer.layer_wise_optimizer.LayerWiseDistributedOptimizer.load_state_dict':
                '187856bb85ce9ae6',
        },
    },
    'mla_local_attention': {
        'verdict': 'patched',
        'targets': {
            'megatron.core.transformer.dot_product_attention.DotProductAttention.__init__':
                '5f3b4356c0288869',
        },
    },
    'muon_fp8_param_gather': {
        'verdict': 'patched',
        'targets': {
            'StepTable.muon_fp8_param_gather':
                'absent',
            'megatron.core.optimizer.distrib_optimizer.DistributedOptimizer.start_param_sync_for_bucket_group_subset':
                'f21a21ea44431353',
            'megatron.core.optimizer.layer_wise_optimizer.LayerWiseDistributedOptimizer._copy_main_params_to_param_buffer':
                'absent',
            'megatron.core.optimizer.layer_wise_optimizer.LayerWiseDistributedOptimizer.prepare_model_params_for_param_sync':
                'absent',
            'megatron.core.optimizer.layer_wise_optimizer.LayerWiseDistributedOptimizer.start_param_sync_for_bucket_group_subset':
                '0d7e82cf534db82b',
            'megatron.core.optimizer.layer_wise_optimizer.LayerWiseDistributedOptimizer.step_with_ready_grads':
                '77e10ca98415f5f7',
            'megatron.core.optimizer.optimizer.ChainedOptimizer._enable_deferred_mxfp8_param_sync':
                '936523eb3fadf231',
            'megatron.training.arguments.validate_args':
                'd4f120126cd64413',
        },
    },
    'pretrained_load_masters': {
        'verdict': 'patched',
        'targets': {
            'megatron.core.dist_checkpointing.load':
                '693c7a352c6fc8ef',
        },
    },
    'restage_forced_sync': {
        'verdict': 'patched',
        'targets': {
            'megatron.core.distributed.distributed_data_parallel.DistributedDataParallel.forward':
                'absent',
            'megatron.core.distributed.distributed_data_parallel.DistributedDataParallel.start_param_sync':
                'b5c9f064786d7271',
            'megatron.core.distributed.distributed_data_parallel.DistributedDataParallel.zero_grad_buffer':
                '832fcb67ee1ee6aa',
            'megatron.core.optimizer.distrib_optimizer.DistributedOptimizer._copy_main_params_to_param_buffer':
                '5315ea6d9e2326d6',
            'megatron.core.optimizer.distrib_optimizer.DistributedOptimizer.step_with_ready_grads':
                'a9157f46f0f528b9',
            'megatron.core.optimizer.optimizer.ChainedOptimizer.prepare_model_params_for_param_sync':
                '7e6d7e0f98273450',
        },
    },
    'te_grouped_checkpoint': {
        'verdict': 'patched',
        'targets': {
            'megatron.core.extensions.transformer_engine.TEGroupedLinear._sharded_state_dict_grouped':
                '52f42c9f084b6c58',
            'megatron.core.transformer.moe.experts.TEGroupedMLP.sharded_state_dict':
                'f3fdfc6c0013742c',
        },
    },
}

FINGERPRINTS: dict[str, dict[str, dict[str, object]]] = {
    'megatron-bridge 0.6.2': {
        'bridge_checkpoint_compat': {
            'verdict': 'patched',
            'targets': {
                'megatron.bridge.training.checkpointing._load_checkpoint_from_path':
                    '5e60f7925ffa1eae',
                'megatron.bridge.training.checkpointing.read_run_config':
                    '9287d5ea206b77b1',
            },
        },
        'bridge_checkpoint_rng': {
            'verdict': 'patched',
            'targets': {
                'megatron.bridge.training.checkpointing.get_rng_state':
                    'aab0cd5a35eec302',
            },
        },
        'bridge_checkpoint_sharding': {
            'verdict': 'patched',
            'targets': {
                'megatron.bridge.training.checkpointing._build_sharded_state_dict_metadata':
                    '1d93e65d4586978a',
                'megatron.bridge.training.checkpointing.save_checkpoint':
                    'fdef9a6226245d2e',
            },
        },
        'bridge_config_guards': {
            'verdict': 'patched',
            'targets': {
                'megatron.bridge.training.config.ConfigContainer.validate':
                    '5e1ddc3d7adcc624',
            },
        },
        'bridge_layer_wise_wrap': {
            'verdict': 'patched',
            'targets': {
                'megatron.bridge.models.model_provider._ddp_wrap':
                    '7bd58a1472ef344d',
            },
        },
        'bridge_save_param_sync': {
            'verdict': 'patched',
            'targets': {
                'megatron.bridge.training.train.save_checkpoint_and_time':
                    'ecd86b90e229b01d',
            },
        },
    },
    'megatron-bridge 0.7.0': {
        'bridge_checkpoint_compat': {
            'verdict': 'patched',
            'targets': {
                'megatron.bridge.training.checkpointing._load_checkpoint_from_path':
                    '139bcc598e98502b',
                'megatron.bridge.training.checkpointing.read_run_config':
                    '9287d5ea206b77b1',
            },
        },
        'bridge_checkpoint_rng': {
            'verdict': 'patched',
            'targets': {
                'megatron.bridge.training.checkpointing.get_rng_state':
                    'aab0cd5a35eec302',
            },
        },
        'bridge_checkpoint_sharding': {
            'verdict': 'patched',
            'targets': {
                'megatron.bridge.training.checkpointing._build_sharded_state_dict_metadata':
                    '1d93e65d4586978a',
                'megatron.bridge.training.checkpointing.save_checkpoint':
                    '535e3277e5a9fc60',
            },
        },
        'bridge_config_guards': {
            'verdict': 'patched',
            'targets': {
                'megatron.bridge.training.config.ConfigContainer.validate':
                    '61cfe9846fac229e',
            },
        },
        'bridge_layer_wise_wrap': {
            'verdict': 'patched',
            'targets': {
                'megatron.bridge.models.model_provider._ddp_wrap':
                    '88813c5a1524ea83',
            },
        },
        'bridge_save_param_sync': {
            'verdict': 'patched',
            'targets': {
                'megatron.bridge.training.train.save_checkpoint_and_time':
                    'ecd86b90e229b01d',
            },
        },
    },
    'megatron-core 0.19.0': _MEGATRON_CORE_0_19_0,
    'megatron-core 0.19.2': _MEGATRON_CORE_0_19_0,
    'megatron-core 0.20.0': {
        'blockwise_fp8_param_gather': {
            'verdict': 'patched',
            'targets': {
                'StepTable.blockwise_fp8_param_gather':
                    'absent',
                'megatron.core.distributed.distributed_data_parallel.partition_buckets':
                    'd7678726be50a815',
                'megatron.core.distributed.param_and_grad_buffer._ParamAndGradBucketGroup._post_param_sync':
                    'c47e5af504b57c35',
                'megatron.core.distributed.param_and_grad_buffer._ParamAndGradBucketGroup.finish_param_sync':
                    '7449ad5184a97a3d',
                'megatron.core.distributed.param_and_grad_buffer._ParamAndGradBucketGroup.start_param_sync':
                    '1c5de736acc08df8',
            },
        },
        'compact_layout': {
            'verdict': 'patched',
            'targets': {
                'StepTable.compact_layout':
                    'absent',
                'megatron.core.distributed.distributed_data_parallel.partition_buckets':
                    'd7678726be50a815',
                'megatron.core.distributed.param_and_grad_buffer._ParamAndGradBucketGroup.finish_param_sync':
                    '7449ad5184a97a3d',
                'megatron.core.distributed.param_and_grad_buffer._ParamAndGradBucketGroup.start_grad_sync':
                    '29bbd6d8b1aa8e22',
                'megatron.core.distributed.param_and_grad_buffer._ParamAndGradBucketGroup.start_param_sync':
                    '1c5de736acc08df8',
                'megatron.core.distributed.param_and_grad_buffer._ParamAndGradBuffer.__init__':
                    'ab2057b8a24c9a3d',
                'megatron.core.optimizer.layer_wise_optimizer.LayerWiseDistributedOptimizer.compute_full_param_layout':
                    'a7e051ef262d58d7',
                'megatron.core.optimizer.layer_wise_optimizer.LayerWiseDistributedOptimizer.shard_params':
                    'bb95ba64498e0cad',
                'megatron.core.optimizer.layer_wise_optimizer.LayerWiseDistributedOptimizer.sharded_state_dict':
                    '7e0eb43ccdd733ed',
            },
        },
        'grouped_weight_layerwise': {
            'verdict': 'patched',
            'targets': {
                'megatron.core.optimizer.emerging_optimizers.TensorParallelMuon.orthogonalize':
                    '935648252eef5970',
                "megatron.core.optimizer.emerging_optimizers._EMERGING_OPTIMIZERS['adaptive_muon'].default_param_overrides":
                    '49cdd61b94c6be0a',
                "megatron.core.optimizer.emerging_optimizers._EMERGING_OPTIMIZERS['muon'].default_param_overrides":
                    '49cdd61b94c6be0a',
                'megatron.core.optimizer.emerging_optimizers._is_nonlinear_or_embedding':
                    '3a10b0b405507187',
                'megatron.core.optimizer.is_managed_by_layer_wise_optimizer':
                    '8004ebf7e4f26a86',
                'megatron.core.optimizer.layer_wise_optimizer.is_managed_by_layer_wise_optimizer':
                    '8004ebf7e4f26a86',
            },
        },
        'layer_wise_init': {
            'verdict': 'patched',
            'targets': {
                'megatron.core.optimizer.layer_wise_optimizer.LayerWiseDistributedOptimizer.__init__':
                    '72277b6a91d7fbdb',
            },
        },
        'layer_wise_load_rederive': {
            'verdict': 'patched',
            'targets': {
                'megatron.core.optimizer.layer_wise_optimizer.LayerWiseDistributedOptimizer.load_state_dict':
                    '187856bb85ce9ae6',
            },
        },
        'mla_local_attention': {
            'verdict': 'patched',
            'targets': {
                'megatron.core.transformer.dot_product_attention.DotProductAttention.__init__':
                    '5f3b4356c0288869',
            },
        },
        'muon_fp8_param_gather': {
            'verdict': 'patched',
            'targets': {
                'StepTable.muon_fp8_param_gather':
                    'absent',
                'megatron.core.optimizer.distrib_optimizer.DistributedOptimizer.start_param_sync_for_bucket_group_subset':
                    'f21a21ea44431353',
                'megatron.core.optimizer.layer_wise_optimizer.LayerWiseDistributedOptimizer._copy_main_params_to_param_buffer':
                    'absent',
                'megatron.core.optimizer.layer_wise_optimizer.LayerWiseDistributedOptimizer.prepare_model_params_for_param_sync':
                    'absent',
                'megatron.core.optimizer.layer_wise_optimizer.LayerWiseDistributedOptimizer.start_param_sync_for_bucket_group_subset':
                    '0d7e82cf534db82b',
                'megatron.core.optimizer.layer_wise_optimizer.LayerWiseDistributedOptimizer.step_with_ready_grads':
                    '77e10ca98415f5f7',
                'megatron.core.optimizer.optimizer.ChainedOptimizer._enable_deferred_mxfp8_param_sync':
                    '936523eb3fadf231',
                'megatron.training.arguments.validate_args':
                    '695a28a3abd5a12d',
            },
        },
        'pretrained_load_masters': {
            'verdict': 'patched',
            'targets': {
                'megatron.core.dist_checkpointing.load':
                    '129d0dbf467e0026',
            },
        },
        'restage_forced_sync': {
            'verdict': 'patched',
            'targets': {
                'megatron.core.distributed.distributed_data_parallel.DistributedDataParallel.forward':
                    'absent',
                'megatron.core.distributed.distributed_data_parallel.DistributedDataParallel.start_param_sync':
                    'b5c9f064786d7271',
                'megatron.core.distributed.distributed_data_parallel.DistributedDataParallel.zero_grad_buffer':
                    '832fcb67ee1ee6aa',
                'megatron.core.optimizer.distrib_optimizer.DistributedOptimizer._copy_main_params_to_param_buffer':
                    '5315ea6d9e2326d6',
                'megatron.core.optimizer.distrib_optimizer.DistributedOptimizer.step_with_ready_grads':
                    'a9157f46f0f528b9',
                'megatron.core.optimizer.optimizer.ChainedOptimizer.prepare_model_params_for_param_sync':
                    '7e6d7e0f98273450',
            },
        },
        'te_grouped_checkpoint': {
            'verdict': 'patched',
            'targets': {
                'megatron.core.extensions.transformer_engine.TEGroupedLinear._sharded_state_dict_grouped':
                    '52f42c9f084b6c58',
                'megatron.core.transformer.moe.experts.TEGroupedMLP.sharded_state_dict':
                    'f3fdfc6c0013742c',
            },
        },
    },
}
