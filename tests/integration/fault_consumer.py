"""Test-only consumer entry: ``specforge_kimi train`` whose rank SIGKILLs itself right after
SpecForge saved the checkpoint of step ``FAULT_AFTER_SAVE_STEP`` (once: ``FAULT_MARKER``).

A crash at a checkpointed step is the case SpecForge 0.2.0 can resume online (its ledger's
durable step then equals the checkpoint's); an outside kill lands there only by chance."""

import os
import signal
import sys
from pathlib import Path


def main() -> int:
    step = int(os.environ["FAULT_AFTER_SAVE_STEP"])
    marker = Path(os.environ["FAULT_MARKER"])
    from specforge.training.controller import TrainerController

    original = TrainerController.save_checkpoint

    def save_checkpoint(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        if self.global_step == step and not marker.exists():
            marker.write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)
        return out

    TrainerController.save_checkpoint = save_checkpoint
    from specforge_kimi.cli import main as cli_main

    return cli_main(sys.argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
