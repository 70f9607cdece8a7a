"""The run: launch under SpecForge's supervisor, services, keepers, the ledger, resume, stop, progress and
GPU-memory sampling, and a recipe's offline twin. Everything here reads the plan; nothing here validates a recipe.
"""
