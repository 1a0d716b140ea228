"""Shared test helpers: tiny checkpoints, engine stepping with invariants, oracles against transformers."""
