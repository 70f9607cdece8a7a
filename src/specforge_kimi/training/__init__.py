"""SpecForge's own trainer run in-process (offline features) and the shims it needs on a CPU."""
