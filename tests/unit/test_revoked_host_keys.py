"""``RevokedHostKeys`` files as OpenSSH reads them: a KRL (``ssh-keygen -k``) or public
keys one a line; ``ssh-keygen -Q`` is the oracle for what a file revokes. A file that
cannot be read refuses the connection, as ``sshkey_check_revoked`` does."""

from __future__ import annotations

import base64
import shutil
import subprocess
from pathlib import Path

import pytest

from torchherd.transport import knownhosts
from torchherd.transport.knownhosts import RevokedKeysError, load_revoked
from torchherd.transport.sshconfig import Local, lookup

KEYGEN = shutil.which("ssh-keygen")
needs_keygen = pytest.mark.skipif(KEYGEN is None, reason="needs OpenSSH's ssh-keygen")


def make_keys(tmp_path: Path, count: int) -> list[Path]:
    paths = []
    for index in range(count):
        path = tmp_path / f"key{index}"
        subprocess.run([str(KEYGEN), "-q", "-t", "ed25519", "-N", "", "-C", f"key{index}", "-f", str(path)],
                       check=True)
        paths.append(path.with_suffix(".pub"))
    return paths


def blob(public: Path) -> bytes:
    return base64.b64decode(public.read_text().split()[1])


def keygen_says_revoked(revoked: Path, public: Path) -> bool:
    """``ssh-keygen -Q``: KRLs only (a list of keys it calls a bad KRL; ssh reads both)."""
    done = subprocess.run([str(KEYGEN), "-Q", "-f", str(revoked), str(public)], capture_output=True, text=True,
                          check=False)
    return "REVOKED" in done.stdout


def krl(tmp_path: Path, name: str, spec: str) -> Path:
    (tmp_path / f"{name}.spec").write_text(spec)
    path = tmp_path / name
    subprocess.run([str(KEYGEN), "-q", "-k", "-f", str(path), str(tmp_path / f"{name}.spec")], check=True,
                   capture_output=True)
    return path


@needs_keygen
def test_what_a_file_revokes_agrees_with_ssh_keygen(tmp_path: Path) -> None:
    keys = make_keys(tmp_path, 4)
    fingerprint = subprocess.run([str(KEYGEN), "-lf", str(keys[2])], capture_output=True, text=True,
                                 check=True).stdout.split()[1]
    files = {
        "explicit": krl(tmp_path, "explicit.krl", keys[0].read_text()),
        "sha1": krl(tmp_path, "sha1.krl", "sha1: " + keys[1].read_text()),
        "sha256": krl(tmp_path, "sha256.krl", f"hash: {fingerprint}\n"),
    }
    for kind, revoked in files.items():
        loaded = load_revoked(str(revoked))
        verdicts = [loaded.revokes(blob(key)) for key in keys]
        assert verdicts == [keygen_says_revoked(revoked, key) for key in keys], kind
        assert any(verdicts), kind


@needs_keygen
def test_a_list_of_keys_revokes_each_key_it_lists(tmp_path: Path) -> None:
    keys = make_keys(tmp_path, 3)
    listed = tmp_path / "revoked_keys"
    listed.write_text("# retired\n\n" + keys[0].read_text() + "   " + keys[2].read_text())
    loaded = load_revoked(str(listed))
    assert [loaded.revokes(blob(key)) for key in keys] == [True, False, True]


def test_a_file_that_cannot_be_read_is_an_error_not_an_empty_list(tmp_path: Path) -> None:
    with pytest.raises(RevokedKeysError, match="No such file"):
        load_revoked(str(tmp_path / "missing"))
    bad = tmp_path / "bad"
    bad.write_text("ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOkey\nnot a key at all\n")
    with pytest.raises(RevokedKeysError, match="line 1: not a public key"):
        load_revoked(str(bad))
    truncated = tmp_path / "truncated.krl"
    truncated.write_bytes(knownhosts.KRL_MAGIC + b"\0\0\0\1" + b"\0" * 10)
    with pytest.raises(RevokedKeysError, match="truncated"):
        load_revoked(str(truncated))
    signed = tmp_path / "signed.krl"
    header = knownhosts.KRL_MAGIC + (1).to_bytes(4, "big") + bytes(24) + bytes(4) + bytes(4)
    signed.write_bytes(header + bytes([4]) + (3).to_bytes(4, "big") + b"abc")
    with pytest.raises(RevokedKeysError, match="signature"):
        load_revoked(str(signed))


def test_the_config_names_the_files_with_tokens_and_none(tmp_path: Path) -> None:
    config = tmp_path / "config"
    config.write_text("Host a\n    RevokedHostKeys ~/.ssh/revoked_%h ${KRLDIR}/all.krl\n"
                      "Host b\n    RevokedHostKeys none\n")
    local = Local(user="me", home=str(tmp_path), uid=1000, hostname="laptop", environ={"KRLDIR": "/etc/krl"})
    assert lookup("a", config, local).revoked_host_keys == (f"{tmp_path}/.ssh/revoked_a", "/etc/krl/all.krl")
    assert lookup("b", config, local).revoked_host_keys == ()
    assert lookup("c", config, local).revoked_host_keys == ()
