"""Errors raised while loading plugins and resolving registered names."""


class PluginError(Exception):
    """A plugin could not be loaded, registered twice, or registered something malformed."""


class UnknownNameError(PluginError, LookupError):
    """A configured name is not in its registry; the message lists the known names."""

    def __init__(self, kind: str, name: str, known: list[str]) -> None:
        self.kind, self.name, self.known = kind, name, sorted(known)
        super().__init__(f"unknown {kind} {name!r}; known {kind}s: {', '.join(self.known) or '(none)'}")
