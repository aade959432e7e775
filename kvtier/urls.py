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
    replaced by ``***``, and likewise inside a query value that is itself a URL (a metadata server's
    ``http://user:password@host``); anything else unchanged (a string that is not a URL is returned
    as is).

    The ``user:password@`` part ends at the last ``@`` before the query: a password may hold ``/`` or
    ``#`` (base64 holds ``/``), which a URL reader takes for the path or the fragment, and a URL that
    does not parse is still shown, in its error."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    qpos = rest.find("?")
    at = rest.rfind("@", 0, qpos if qpos >= 0 else len(rest))
    cred = ""
    if at >= 0:
        user, colon, _ = rest[:at].partition(":")
        cred, rest = f"{user}{':' + MASK if colon else ''}@", rest[at + 1:]
    rest, hash_, fragment = rest.partition("#")
    rest, q, query = rest.partition("?")
    if query:
        parts = []
        for item in query.split("&"):
            name, eq, value = item.partition("=")
            secret = eq and unquote_plus(name).strip().lower() in SECRET_PARAMS  # as the URL's reader decodes it
            if secret:
                item = f"{name}={MASK}"
            elif "://" in unquote_plus(value):
                inner = unquote_plus(value)
                if mask_url(inner) != inner:
                    item = f"{name}={mask_url(inner)}"
            parts.append(item)
        query = "&".join(parts)
    return f"{scheme}://{cred}{rest}{q}{query}{hash_}{fragment}"
