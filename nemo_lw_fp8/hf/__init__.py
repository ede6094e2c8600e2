"""Hugging Face checkpoints in and out of the recipes: ``nemo-lw-fp8 hf-import`` / ``hf-export``.

Megatron-Bridge converts the weights; this wing gives it what it needs on any machine
(:mod:`.setup`), checks a recipe against an HF config (:mod:`.checks`), refuses missing weights
by name (:mod:`.importer`) and exports a run's trained weights, its fp32 masters, not only the
FP8 weights it computed with (:mod:`.exporter`). docs/hf.md is the user's page. Nothing here is
imported when the package is: the commands import these modules when they run.
"""
