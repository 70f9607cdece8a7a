"""The online run: recipes rendered to SpecForge configs, the text-only SGLang capture server and its
Mooncake settings, the co-located launch under SpecForge's supervisor, what keeps a run alive
(keepers), ``setup`` / ``doctor``, the CPU reference capture server, and a recipe's offline twin.
"""
