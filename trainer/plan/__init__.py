"""The dry-run planner (`python -m trainer --dry_run`): memory and step time of a config,
compiled for described GPUs or fake CPU devices, before any hardware is rented."""
