"""The one exception type our commands turn into a single clear error line, and the one-line form
of a pydantic validation error it carries (recipes, SpecForge run configs).

Scope: raised for bad user input (configs, checkpoints, ids, files). Bugs stay ordinary
exceptions with tracebacks; the CLI prints ``error: <message>`` and exits 2 only for these.
"""


class KimiInputError(ValueError):
    """Bad input with a message that names the cause and, where known, the fix."""


def validation_summary(exc, limit: int = 3) -> str:
    """A pydantic ``ValidationError`` on one line: each error as ``loc: msg`` (a whole-model check has no
    loc), ``; ``-joined, at most ``limit`` of them (a misspelt required key gives two: missing and extra).
    Characters that are not printable (a key holding a line break, U+2028) are escaped, so it stays one line."""
    parts = []
    for err in exc.errors()[:limit]:
        loc = ".".join(str(x) for x in err["loc"])
        parts.append(f"{loc}: {err['msg']}" if loc else err["msg"])
    more = len(exc.errors()) - limit
    text = "; ".join(parts) + (f"; and {more} more" if more > 0 else "")
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
