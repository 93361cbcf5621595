"""EPFlow inside training frameworks: `epflow.integrations.megatron` (Megatron-Core's MoE layer
backed by EPFlow) and `epflow.integrations.torchtitan` (torchtitan's routed experts). Each
module imports its framework when imported itself, so `import epflow` never needs one."""
