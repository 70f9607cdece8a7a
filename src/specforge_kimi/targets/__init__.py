"""The target: K2.5's config nesting and weight names, checkpoint checks, the torch text model,
aux-layer-id conventions, the reference capture hooks, and tiny K2.5-shaped checkpoints.

Sits on :mod:`specforge_kimi.data` (a tiny checkpoint carries a stand-in tokenizer).
"""
