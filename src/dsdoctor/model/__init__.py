"""What a model is, from its config.json alone: sizes and parameter counts (no torch needed)."""
