"""Storage URLs as they may be shown: every password masked, in errors, progress lines and recorded commands.

A PostgreSQL or MySQL storage URL carries its password (``postgresql://user:PASSWORD@host/db``, or a
``?password=`` query parameter). The URL must work inside the process, but nothing that leaves it (an error
message, the progress display, the ``command:`` a results file records) may show the password. Imports nothing
heavy: ``lab`` masks its command line with it before any command module loads.
"""

from __future__ import annotations

import re
from urllib.parse import unquote

MASK = "***"

# query parameters that carry a password (libpq's ``password``, MySQL drivers' ``passwd``/``pwd``)
_PASSWORD_QUERY = re.compile(r"(?i)([?&](?:password|passwd|pwd)=)([^&#]*)")


def _split_userinfo(url: str) -> tuple[str, str, str, str] | None:
    """``(scheme, user, password, rest)`` of ``scheme://user:password@rest``, or None without a password.

    The password ends at the *last* ``@``: a raw ``@`` or ``/`` in it is then masked with it (showing too little of a
    URL is safe; showing part of a password is not)."""
    scheme, sep, tail = url.partition("://")
    at = tail.rfind("@")
    if not sep or at < 0:
        return None
    user, colon, password = tail[:at].partition(":")
    if not colon or "/" in user:
        return None  # no password, or the ``:`` and ``@`` belong to the path or query
    return scheme, user, password, tail[at + 1 :]


def mask_url(url: str) -> str:
    """``url`` with its password shown as ``***``: ``postgresql://user:***@host/db``; other text is returned as it is."""
    parts = _split_userinfo(url)
    if parts is not None:
        scheme, user, _, rest = parts
        url = f"{scheme}://{user}:{MASK}@{rest}"
    return _PASSWORD_QUERY.sub(rf"\g<1>{MASK}", url)


def passwords(url: str) -> list[str]:
    """The passwords ``url`` carries, as written and percent-decoded (what a driver's error message might quote)."""
    found = [m.group(2) for m in _PASSWORD_QUERY.finditer(url)]
    parts = _split_userinfo(url)
    if parts is not None:
        found.append(parts[2])
    return sorted({p for raw in found for p in (raw, unquote(raw)) if p}, key=len, reverse=True)


def scrub(text: str, url: str) -> str:
    """``text`` (an exception's message, say) with ``url`` masked and its passwords blanked wherever they appear."""
    text = text.replace(url, mask_url(url))
    for password in passwords(url):
        text = text.replace(password, MASK)
    return text


def mask_argv(argv: list[str]) -> list[str]:
    """A command line as it may be recorded: every argument's URL password masked (``--storage URL`` and
    ``--storage=URL`` alike)."""
    return [mask_url(arg) for arg in argv]
