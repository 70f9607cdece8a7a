"""The data stage: K2.5's chat format and tokenizer, conversations to training rows, target
regeneration, the draft vocab mapping, and the prompt sets (chat/math/code and the synthetic corpus).

Bottom layer: imports nothing of specforge_kimi but :mod:`specforge_kimi.errors`.
"""
