"""Machine set-up: the patch set applied to and checked in the pinned SpecForge and SGLang, and ``doctor``."""
