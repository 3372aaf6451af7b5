"""Bearer API keys (`REWA_API_KEYS`): each key owns a namespace of contexts (a hash of the
key, so keys never appear in store keys); without keys everything is in one public namespace.
Probes, metrics and the API documentation are open.

`Authentication` checks the key of every `/v1/` request before anything else happens to it
(before its body is read: an unauthenticated client cannot make the service buffer a body),
and leaves the caller's namespace in the request's state for the `namespace_of` dependency."""

from __future__ import annotations

import hashlib
import hmac
import re

from fastapi import Request, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.datastructures import Headers

from .errors import ApiError, error_response

PUBLIC_NAMESPACE = "public"
PROTECTED_PREFIX = "/v1/"
_BEARER = re.compile(r"[Bb][Ee][Aa][Rr][Ee][Rr] ([A-Za-z0-9\-._~+/]+=*)")


def namespaces_for(keys: list[str]) -> dict[str, str]:
    """Each API key's namespace."""
    return {key: hashlib.sha256(key.encode()).hexdigest()[:16] for key in keys}


def namespace_for_header(authorization: str, keys: dict[str, str]) -> str | None:
    """The namespace of an `Authorization` header value, or None when it names no key.

    The header must be exactly `Bearer <token>`: one space, a token of RFC 6750's `b64token`
    characters, no padding (the scheme name is case-insensitive, RFC 7235 section 2.1). The
    token is compared with every key in constant time (`hmac.compare_digest` on SHA-256
    digests), so the time taken says nothing about how much of a key matched."""
    match = _BEARER.fullmatch(authorization)
    namespace = None
    if match is not None:
        digest = hashlib.sha256(match.group(1).encode()).digest()
        for key, key_namespace in keys.items():
            if hmac.compare_digest(digest, hashlib.sha256(key.encode()).digest()):
                namespace = key_namespace
    return namespace


class Authentication:
    """401 for a `/v1/` request without a valid key (when keys are configured); otherwise the
    caller's namespace goes to `scope["state"]["namespace"]`."""

    def __init__(self, app, keys: dict[str, str]) -> None:
        self.app = app
        self.keys = keys

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith(PROTECTED_PREFIX):
            return await self.app(scope, receive, send)
        namespace = PUBLIC_NAMESPACE
        if self.keys:
            authorization = Headers(scope=scope).get("authorization", "")
            namespace = namespace_for_header(authorization, self.keys)
            if namespace is None:
                refused = ApiError(
                    401,
                    "expected an Authorization: Bearer <api key> header with a valid key",
                    "Authorization",
                    headers={"WWW-Authenticate": "Bearer"},
                )
                return await error_response(refused)(scope, receive, send)
        scope.setdefault("state", {})["namespace"] = namespace
        return await self.app(scope, receive, send)


# Declares the Bearer scheme in the OpenAPI document (`Authentication` does the checking).
_SCHEME = Security(HTTPBearer(auto_error=False, description="an API key of REWA_API_KEYS"))


def namespace_of(request: Request, _: HTTPAuthorizationCredentials | None = _SCHEME) -> str:
    """The caller's namespace, as `Authentication` found it."""
    return request.state.namespace
