"""The one exception type our commands turn into a single clear error line.

Scope: raised for bad user input (configs, checkpoints, ids, files). Bugs stay ordinary
exceptions with tracebacks; the CLI prints ``error: <message>`` and exits 2 only for these.
"""


class KimiInputError(ValueError):
    """Bad input with a message that names the cause and, where known, the fix."""
