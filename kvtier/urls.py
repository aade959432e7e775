"""Showing a URL without its secrets (one concept: the mask every log, error and status route uses).

A URL can carry a password in two places: ``scheme://user:PASSWORD@host`` and the query
(``redis://host:6379/0?password=PASSWORD``, which redis-py reads as the password; tokens and
keys of object stores likewise). :func:`mask_url` replaces both with ``***``.
"""

from __future__ import annotations

from urllib.parse import unquote_plus

#: Query parameter names whose value is a secret (compared lower-cased).
SECRET_PARAMS = frozenset({
    "password", "passwd", "pass", "pwd", "secret", "token", "auth", "auth_token", "access_token",
    "api_key", "apikey", "access_key", "secret_key", "aws_secret_access_key", "sas", "sig", "signature",
    "credential", "credentials", "session_token",
})
MASK = "***"


def mask_url(url: str) -> str:
    """``url`` with the password of its ``user:password@`` part and the value of every query
    parameter named in :data:`SECRET_PARAMS` (after percent-decoding the name, as redis-py does)
    replaced by ``***``; anything else unchanged (a string that is not a URL is returned as is)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    rest, hash_, fragment = rest.partition("#")
    rest, q, query = rest.partition("?")
    netloc, slash, path = rest.partition("/")
    if "@" in netloc:
        cred, _, host = netloc.rpartition("@")
        user, colon, _ = cred.partition(":")
        netloc = f"{user}{':' + MASK if colon else ''}@{host}"
    if query:
        parts = []
        for item in query.split("&"):
            name, eq, _ = item.partition("=")
            secret = eq and unquote_plus(name).strip().lower() in SECRET_PARAMS  # as the URL's reader decodes it
            parts.append(f"{name}={MASK}" if secret else item)
        query = "&".join(parts)
    return f"{scheme}://{netloc}{slash}{path}{q}{query}{hash_}{fragment}"
