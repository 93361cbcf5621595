"""EPFlow inside training frameworks: `epflow.integrations.megatron` (Megatron-Core's MoE layer
backed by EPFlow). Each module imports its framework when imported itself, so `import epflow`
never needs one."""
