"""The embedded CPU demo and the tiny-target tools around it: pretraining a tiny K2.5 on the
synthetic corpus (and prompt rules), ``eval-draft``, ``target-text``. Tiny targets only."""
