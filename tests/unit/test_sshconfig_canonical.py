"""``CanonicalizeHostname`` where a suffix resolves: what the ``ssh -G`` corpus cannot show
on a machine whose DNS answers none of its names. The resolver is the ``Local``'s, so
these run without DNS; each case is OpenSSH's ``resolve_canonicalize`` (ssh.c)."""

from __future__ import annotations

from pathlib import Path

import pytest

from torchherd.transport.sshconfig import HostConfig, Local, SshConfigError, lookup


def resolve(tmp_path: Path, text: str, alias: str, known: set[str]) -> tuple[HostConfig, list[str]]:
    asked: list[str] = []

    def resolves(name: str) -> bool:
        asked.append(name)
        return name in known

    config = tmp_path / "config"
    config.write_text(text)
    local = Local(user="me", home=str(tmp_path), uid=1000, hostname="laptop", resolves=resolves)
    return lookup(alias, config, local), asked


CANONICAL = """CanonicalizeHostname yes
CanonicalDomains lab.example corp.example
Host *.corp.example
    User corp-user
    Port 2200
Host web
    Port 2201
"""


def test_the_first_suffix_that_resolves_names_the_host_and_the_second_pass_sees_it(tmp_path: Path) -> None:
    found, asked = resolve(tmp_path, CANONICAL, "web", {"web.corp.example."})
    assert asked == ["web.lab.example.", "web.corp.example."]  # in order, anchored with a final dot
    assert found.hostname == "web.corp.example"
    assert found.user == "corp-user"  # the second pass's Host line for the canonical name
    assert found.port == 2201  # the first pass's Port came first
    assert found.host_key_name == "[web.corp.example]:2201"


def test_none_ends_the_domains_and_max_dots_leaves_qualified_names_alone(tmp_path: Path) -> None:
    text = "CanonicalizeHostname yes\nCanonicalDomains none\nCanonicalizeMaxDots 1\n"
    found, asked = resolve(tmp_path, text, "web", {"web.none."})
    assert (found.hostname, asked) == ("web", [])
    found, asked = resolve(tmp_path, CANONICAL, "a.b.c", {"a.b.c.lab.example."})
    assert (found.hostname, asked) == ("a.b.c", [])


def test_an_anchored_name_is_resolved_as_it_is_and_loses_its_dot(tmp_path: Path) -> None:
    found, asked = resolve(tmp_path, CANONICAL, "db.corp.example.", {"db.corp.example."})
    assert (found.hostname, found.user, asked) == ("db.corp.example", "corp-user", ["db.corp.example."])


def test_the_hostname_is_what_gets_canonicalized(tmp_path: Path) -> None:
    found, _ = resolve(tmp_path, "Host gpu-a\n    HostName Node7\n" + CANONICAL, "gpu-a", {"node7.lab.example."})
    assert found.hostname == "node7.lab.example"


def test_a_proxied_host_is_canonicalized_only_with_always(tmp_path: Path) -> None:
    jump = "Host *\n    ProxyJump bastion\n"
    found, asked = resolve(tmp_path, CANONICAL + jump, "web", {"web.lab.example."})
    assert (found.hostname, asked) == ("web", [])
    always = CANONICAL.replace("CanonicalizeHostname yes", "CanonicalizeHostname always")
    found, _ = resolve(tmp_path, always + jump, "web", {"web.lab.example."})
    assert found.hostname == "web.lab.example"


def test_without_fallback_an_unresolved_name_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SshConfigError, match="Could not resolve host 'web'"):
        resolve(tmp_path, CANONICAL + "CanonicalizeFallbackLocal no\n", "web", set())


def test_nothing_is_resolved_when_canonicalization_is_off(tmp_path: Path) -> None:
    found, asked = resolve(tmp_path, CANONICAL.replace("yes", "no", 1), "web", {"web.lab.example."})
    assert (found.hostname, asked) == ("web", [])


@pytest.mark.parametrize(("line", "message"), [
    ("CanonicalizeHostname maybe", "yes, no or always"),
    ("CanonicalizeMaxDots -1", "must be a number"),
    ("CanonicalDomains lab none", "must appear alone"),
    ("CanonicalDomains -lab", "starts with invalid character"),
    ("CanonicalDomains lab/x", "invalid characters"),
])
def test_bad_values_are_refused_naming_the_line(tmp_path: Path, line: str, message: str) -> None:
    with pytest.raises(SshConfigError, match=message):
        resolve(tmp_path, f"{line}\nCanonicalizeHostname yes\n", "web", set())


# Facts from paramiko's tests/configs whose names their tests resolve (paramiko.org);
# here the resolver knows exactly the names listed.
PARAMIKO_DNS = {"www.paramiko.org.", "sub.www.paramiko.org.", "subber.sub.www.paramiko.org.",
                "docs.paramiko.org."}
DEEP = """CanonicalizeHostname yes
CanonicalDomains paramiko.org
{maxdots}
Host www.paramiko.org
    User rando
Host sub.www.paramiko.org
    User deep
Host subber.sub.www.paramiko.org
    User deeper
"""


@pytest.mark.parametrize(("maxdots", "alias", "user"), [
    ("", "www", "rando"), ("", "sub.www", "deep"), ("", "subber.sub.www", "me"),
    ("CanonicalizeMaxDots 2", "subber.sub.www", "deeper"),
    ("CanonicalizeMaxDots 0", "www", "rando"), ("CanonicalizeMaxDots 0", "sub.www", "me"),
])
def test_paramiko_deep_canon_and_max_dots(tmp_path: Path, maxdots: str, alias: str, user: str) -> None:
    found, _ = resolve(tmp_path, DEEP.format(maxdots=maxdots), alias, PARAMIKO_DNS)
    assert found.user == user


def test_paramiko_canon_identity_files_come_from_both_passes(tmp_path: Path) -> None:
    text = ("CanonicalizeHostname yes\nCanonicalDomains paramiko.org\nIdentityFile base.key\n"
            "Host www.paramiko.org\n    User rando\n    IdentityFile canonicalized.key\n")
    found, _ = resolve(tmp_path, text, "www", PARAMIKO_DNS)
    assert (found.user, found.identity_files_as_written) == ("rando", ("base.key", "canonicalized.key"))


def test_paramiko_multi_domains_canon_local_and_fallback(tmp_path: Path) -> None:
    multi = "CanonicalizeHostname yes\nCanonicalDomains not-a-real-tld paramiko.org\nHost www.paramiko.org\n  User rando\n"
    found, asked = resolve(tmp_path, multi, "www", PARAMIKO_DNS)
    assert (found.user, asked) == ("rando", ["www.not-a-real-tld.", "www.paramiko.org."])
    local = ("Host www.paramiko.org\n    User rando\nHost www\n    CanonicalDomains paramiko.org\n"
             "    CanonicalizeHostname yes\n")
    assert resolve(tmp_path, local, "www", PARAMIKO_DNS)[0].user == "rando"
    assert resolve(tmp_path, local, "docs", PARAMIKO_DNS)[0].hostname == "docs"  # not canonicalized there
    with pytest.raises(SshConfigError, match="Could not resolve host 'nope'"):
        resolve(tmp_path, "CanonicalizeFallbackLocal no\n" + multi, "nope", PARAMIKO_DNS)


def test_paramiko_match_host_canonicalized_and_exec_per_pass(tmp_path: Path) -> None:
    text = ("CanonicalizeHostname yes\nCanonicalDomains paramiko.org\nMatch host www.paramiko.org\n    User rand\n"
            "Match canonical host docs.paramiko.org\n    User eric\n")
    assert resolve(tmp_path, text, "www", PARAMIKO_DNS)[0].user == "rand"
    assert resolve(tmp_path, text, "docs", PARAMIKO_DNS)[0].user == "eric"
    ran: list[str] = []
    config = tmp_path / "exec"
    config.write_text("CanonicalDomains paramiko.org\nCanonicalizeHostname always\n"
                      "Match !canonical exec uncanonicalized\n    User defenseless\n"
                      "Match canonical exec canonicalized\n    Port 8007\n")
    local = Local(user="me", home=str(tmp_path), uid=1000, hostname="laptop",
                  run=lambda command: ran.append(command) is None, resolves=PARAMIKO_DNS.__contains__)
    found = lookup("www", config, local)
    assert (found.hostname, found.user, found.port, ran) == ("www.paramiko.org", "defenseless", 8007,
                                                             ["uncanonicalized", "canonicalized"])


def test_proxycommand_none_is_a_direct_connection(tmp_path: Path) -> None:
    found, _ = resolve(tmp_path, "ProxyCommand none\n" + CANONICAL, "web", {"web.lab.example."})
    assert found.hostname == "web.lab.example"
    found, _ = resolve(tmp_path, "ProxyCommand nc %h %p\n" + CANONICAL, "web", {"web.lab.example."})
    assert found.hostname == "web"
