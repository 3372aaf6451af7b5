"""Bearer API keys (`REWA_API_KEYS`): each key owns a namespace of contexts (a hash of the
key, so keys never appear in store keys); without keys everything is in one public namespace.
Probes and metrics are open."""

from __future__ import annotations

import hashlib
import hmac
import re

from fastapi import Request

from .errors import ApiError

PUBLIC_NAMESPACE = "public"
_BEARER = re.compile(r"[Bb][Ee][Aa][Rr][Ee][Rr] ([A-Za-z0-9\-._~+/]+=*)")


def namespaces_for(keys: list[str]) -> dict[str, str]:
    """Each API key's namespace."""
    return {key: hashlib.sha256(key.encode()).hexdigest()[:16] for key in keys}


def namespace_of(request: Request) -> str:
    """The caller's namespace: one per API key (401 without a valid one), or the public
    namespace when no keys are configured.

    The header must be exactly `Bearer <token>`: one space, a token of RFC 6750's `b64token`
    characters, no padding (the scheme name is case-insensitive, RFC 7235 section 2.1). The
    token is compared with every key in constant time (`hmac.compare_digest` on SHA-256
    digests), so the time taken says nothing about how much of a key matched."""
    keys = request.app.state.namespaces
    if not keys:
        return PUBLIC_NAMESPACE
    match = _BEARER.fullmatch(request.headers.get("authorization", ""))
    namespace = None
    if match is not None:
        digest = hashlib.sha256(match.group(1).encode()).digest()
        for key, key_namespace in keys.items():
            if hmac.compare_digest(digest, hashlib.sha256(key.encode()).digest()):
                namespace = key_namespace
    if namespace is None:
        raise ApiError(
            401,
            "expected an Authorization: Bearer <api key> header with a valid key",
            "Authorization",
            headers={"WWW-Authenticate": "Bearer"},
        )
    return namespace
