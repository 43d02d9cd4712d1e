"""Secrets kept out of what is shown: a URL's password, in messages, logs and reprs.

Broker and endpoint URLs may carry ``user:password@``; every message that names
a URL (a config error, an unreachable endpoint, a repr) shows it through
:func:`redact_url`, which keeps the user name (what an operator needs to tell
which credentials were used) and hides the password.
"""

from __future__ import annotations

import re

#: ``scheme://user:password@`` (or ``//user:password@``), however malformed the rest is
_USERINFO = re.compile(r"(//[^/?#@]*?):[^/?#]*@")


def redact_url(url: object) -> str:
    """``url`` with any password in its authority replaced by ``***``."""
    return _USERINFO.sub(r"\1:***@", str(url))
