"""What a run reports: the console, metrics trackers (JSONL, console, W&B), profiles and the
run's provenance."""
