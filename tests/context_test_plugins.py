"""Context providers for the tests: one that remembers a fact, one that raises, one that hangs.
Loaded by a test server through its config's `plugins:` list."""

import anyio

from cadenza.plugins.hookspecs import hookimpl
from cadenza.policies.context import ContextProvider

FACT = "Remember: the code word is PELICAN."


class Fact(ContextProvider):
    name = "test_fact"

    async def provide(self, request):
        return [{"role": "system", "content": FACT}]


class Raising(ContextProvider):
    name = "test_raising"

    async def provide(self, request):
        raise RuntimeError("the memory store is down")


class Hanging(ContextProvider):
    name = "test_hanging"

    async def provide(self, request):
        await anyio.sleep_forever()


@hookimpl
def register_context_providers(register):
    for cls in (Fact, Raising, Hanging):
        register(cls.name, cls)
