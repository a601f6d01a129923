"""Integrations with training frameworks (optional: each imports its framework only
when called). ``moe_fp8_ext.integrations.torchtitan.convert(model)``."""
