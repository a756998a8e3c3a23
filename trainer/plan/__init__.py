"""The dry-run planner (`python -m trainer --dry_run`): memory and step time of a config,
compiled for described GPUs or TPU slices, or fake CPU devices, before any hardware is rented."""

# What a plan compiles for (`--plan_compiler`; plan_target.described_target): here, so that the
# flag is defined without importing JAX.
COMPILERS = ("auto", "gpu", "tpu", "cpu")
