"""Secrets kept out of what is shown: a URL's password, in messages, logs and reprs.

Broker and endpoint URLs may carry ``user:password@``; every message that names
a URL (a config error, an unreachable endpoint, a repr) shows it through
:func:`redact_url`, which keeps the user name (what an operator needs to tell
which credentials were used) and hides the password.
"""

from __future__ import annotations

import re

#: ``//user:`` at the start of an authority (the user name has no ``/?#@:``)
_USER = re.compile(r"//[^/?#@:]*:")


def redact_url(url: object) -> str:
    """``url`` with any password in its authority replaced by ``***``.

    A password may hold an unencoded ``/``, ``?``, ``#`` or ``@`` (generated ones
    often do), which ends a well-formed authority early: everything from the user
    name's ``:`` to the last ``@`` is hidden (a path with an ``@`` in it loses a
    little more than the password: the safe side)."""
    text = str(url)
    user = _USER.search(text)
    if user is None:
        return text
    at = text.rfind("@", user.end())
    if at < 0:
        return text
    return f"{text[: user.end()]}***{text[at:]}"
