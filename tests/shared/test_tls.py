"""The client TLS context: a file that is not what its key says is named with that key."""

from __future__ import annotations

import pytest

from shared.errors import ConfigError
from shared.tls import client_tls_context
from tests.support import make_test_ca


def test_a_usable_ca_and_certificate_pair_build_a_verifying_context(tmp_path) -> None:
    ca, cert, key = make_test_ca(tmp_path / "ca")
    context = client_tls_context(ca, cert_file=cert, key_file=key, section="cloud")
    assert context.check_hostname


def test_files_that_are_not_what_their_key_says_are_named_with_the_key(tmp_path) -> None:
    # OpenSSL alone said "[SSL] PEM lib (_ssl.c:3926)": neither the key nor the file.
    ca, cert, _key = make_test_ca(tmp_path / "ca")
    garbage = tmp_path / "notes.txt"
    garbage.write_text("not a certificate\n")
    with pytest.raises(ConfigError, match=r"key 'cloud\.ca_file' \(.*notes\.txt\) holds no usable"):
        client_tls_context(garbage, section="cloud")
    with pytest.raises(ConfigError, match=r"'mqtt\.cert_file' \(.*ca\.crt\) \(no 'mqtt\.key_file'"):
        client_tls_context(ca, cert_file=ca, section="mqtt")
    with pytest.raises(ConfigError, match=r"'cloud\.cert_file' .* with 'cloud\.key_file'"):
        client_tls_context(ca, cert_file=cert, key_file=garbage, section="cloud")
