"""specforge-kimi: a Kimi-K2.5 target adapter and data path for SpecForge EAGLE-3 training.

Nothing heavy is imported here: importing ``specforge_kimi`` does not import sglang, mooncake,
specforge or CUDA code. Call :func:`register` in every process that runs SpecForge code
(producer, each trainer rank, export, bench); it is idempotent.
"""

from __future__ import annotations

from specforge_kimi.provenance import VERSION as __version__

__all__ = ["register", "__version__"]


def register() -> None:
    """Install the K2.5 adapter into transformers and SpecForge (idempotent).

    - ``kimi_k25`` resolvable by ``AutoConfig`` from a local directory without remote code,
      with hidden/vocab/layer sizes readable at top level (SpecForge reads them there);
    - K2.5 weight keys picked for SpecForge's embedding / target-head loaders;
    - the ``kimi-k2.5`` chat template in SpecForge's ``TEMPLATE_REGISTRY``.
    """
    from specforge_kimi.registration import register_all

    register_all()
