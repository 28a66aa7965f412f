"""API keys and their tenants: which key authenticated a connection and, under
`cache.salt_per_api_key`, the cache salt every request made for that connection carries.

`APIKeys.match` compares a given token with every configured key (`server.api_key` and
`server.api_keys`) in constant time, without stopping at the first match, so its timing tells
nothing of which key matched.

The salt is applied at one place: a salting server's routes see its engine as `TenantEngine`,
which sets each request's `cache_salt` from the tenant in the context variable `CURRENT_TENANT`.
The HTTP middleware sets it for the request it authenticated, a WebSocket's admission for the whole
connection, and the tasks a connection starts inherit it. So every protocol (OpenAI's chat,
completions, Responses and Realtime, Anthropic, Ollama, cadenza's sessions) and every request the
server makes on a connection's behalf (a context policy's summary, a provider's embeddings) is
salted, and a route added later cannot forget to be. A request made outside any connection gets a
salt of its own, which no tenant shares.

A tenant's salt is a keyed blake2b of its name, or of its key where `api_keys` names none: the key
never leaves this module (logs name the tenant, or the key's place in the config; files hold only
chained hashes of the salt). The request's own `cache_salt` is hashed in with it, so a tenant still
separates its users as before, and no request can give a salt that another tenant's requests have.
"""

from __future__ import annotations

import hashlib
import hmac
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from cadenza.config.schema import APIKeyConfig, ServerConfig
from cadenza.sampling_params import SamplingParams

_ROOT_KEY = b"cadenza tenant cache salt"  # blake2b's key: salts are cadenza's, not plain hashes of a key
_SALT_KEY = b"cadenza tenant request salt"


@dataclass(frozen=True)
class Tenant:
    """Who a key belongs to: `label` for logs (the tenant's name, or the key's place in the
    config), `root` the keyed digest its requests' salts start from."""

    label: str
    root: bytes = field(repr=False)

    @classmethod
    def of(cls, entry: APIKeyConfig, place: str) -> Tenant:
        named = entry.tenant is not None
        source = f"tenant\0{entry.tenant}" if named else f"key\0{entry.key}"
        root = hashlib.blake2b(source.encode(), key=_ROOT_KEY, digest_size=16).digest()
        return cls(entry.tenant if named else place, root)

    def cache_salt(self, given: str | None) -> str:
        """The salt a request of this tenant runs under, the request's own `cache_salt` hashed in."""
        data = self.root + (b"\0" if given is None else b"\1" + given.encode())
        return hashlib.blake2b(data, key=_SALT_KEY, digest_size=16).hexdigest()


NO_TENANT = Tenant("(no connection)", hashlib.blake2b(b"no tenant", key=_ROOT_KEY, digest_size=16).digest())

# The tenant whose connection the running task serves; None outside any authenticated connection.
CURRENT_TENANT: ContextVar[Tenant | None] = ContextVar("cadenza_tenant", default=None)


class APIKeys:
    """The keys a server accepts (`server.api_key`, then `server.api_keys`), each with its tenant."""

    def __init__(self, server: ServerConfig) -> None:
        places = ["api_key"] * (server.api_key is not None) + [f"api_keys[{i}]" for i in range(len(server.api_keys))]
        self._keys = [(e.key.encode(), Tenant.of(e, place)) for e, place in zip(server.all_api_keys, places)]

    def __bool__(self) -> bool:
        return bool(self._keys)

    def match(self, given: str) -> Tenant | None:
        """The tenant of the key `given` is, or None."""
        given_bytes, found = given.encode(), None
        for key, tenant in self._keys:
            if hmac.compare_digest(given_bytes, key) and found is None:
                found = tenant
        return found


class TenantEngine:
    """An engine as a salting server's routes see it: the same in every way, but each request's
    `cache_salt` is its tenant's (`CURRENT_TENANT`), its own salt hashed in."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def generate(self, prompt: Any, params: SamplingParams | None = None, **kwargs: Any):
        params = params or SamplingParams()
        tenant = CURRENT_TENANT.get() or NO_TENANT
        salted = params.model_copy(update={"cache_salt": tenant.cache_salt(params.cache_salt)})
        return self.engine.generate(prompt, salted, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)
