"""The plan: a recipe (typed schema) compiled into what a run needs -- SpecForge's config, each role's command
line and environment, the memory split and the transport with the reason it was chosen.

Sits on :mod:`specforge_kimi.servers` (the capture server's command line) and below everything that runs.
"""
