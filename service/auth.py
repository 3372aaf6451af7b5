"""Bearer API keys (`REWA_API_KEYS`): each key owns a namespace of contexts (a hash of the
key, so keys never appear in store keys); without keys everything is in one public namespace.
Probes and metrics are open."""

from __future__ import annotations

import hashlib

from fastapi import Request

from .errors import ApiError

PUBLIC_NAMESPACE = "public"


def namespaces_for(keys: list[str]) -> dict[str, str]:
    """Each API key's namespace."""
    return {key: hashlib.sha256(key.encode()).hexdigest()[:16] for key in keys}


def namespace_of(request: Request) -> str:
    """The caller's namespace: one per API key (401 without a valid one), or the public
    namespace when no keys are configured."""
    keys = request.app.state.namespaces
    if not keys:
        return PUBLIC_NAMESPACE
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or token.strip() not in keys:
        raise ApiError(
            401,
            "expected an Authorization: Bearer <api key> header with a valid key",
            "Authorization",
            headers={"WWW-Authenticate": "Bearer"},
        )
    return keys[token.strip()]
