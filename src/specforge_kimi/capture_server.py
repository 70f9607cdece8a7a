"""``python -m specforge_kimi.capture_server ARGS``: the text-only K2.5 SGLang capture server.

The entry point recipes and the launch render (SGLang's own CLI, ``enable_multimodal=False`` for
K2.5 checkpoints); the code is :mod:`specforge_kimi.servers.capture_server`.
"""

from specforge_kimi.servers.capture_server import main

if __name__ == "__main__":
    main()
