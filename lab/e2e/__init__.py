"""End-to-end timing of the complete model: decode steps and prefill, tiles vs the torch baseline."""
