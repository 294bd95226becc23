"""torchherd's ssh_config resolution agrees with OpenSSH's own, field by field.

Every config under ``data/sshconfig/`` (its first line lists the aliases to resolve)
is copied to a temporary directory (``@DIR@`` becomes that directory, for absolute
``Include`` paths), then each alias is resolved twice: by ``ssh -G -F config alias``
and by ``transport.sshconfig.lookup``. A config that ``ssh`` refuses (it says so in a
``# error:`` line) must be refused by torchherd too.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from torchherd.transport.sshconfig import HostConfig, Local, SshConfigError, _parse_hop, lookup

CORPUS = Path(__file__).parent / "data" / "sshconfig"
CONFIGS = sorted(CORPUS.glob("*.conf"))
SSH = shutil.which("ssh")
pytestmark = pytest.mark.skipif(SSH is None, reason="needs OpenSSH's ssh client for `ssh -G`")

STRICT = {"true": "yes", "false": "no", "ask": "ask", "accept-new": "accept-new"}


def aliases_of(config: Path) -> list[str]:
    first = config.read_text().splitlines()[0]
    assert first.startswith("# aliases: "), f"{config.name}: first line must list the aliases"
    return first[len("# aliases: "):].split()


def expects_error(config: Path) -> bool:
    return "# error:" in config.read_text()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("sshconfig")
    for path in CORPUS.rglob("*.conf"):
        target = directory / path.relative_to(CORPUS)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(path.read_text().replace("@DIR@", str(directory)))
    return directory


def ssh_g(config: Path, alias: str) -> tuple[int, dict[str, list[str]], str]:
    done = subprocess.run([str(SSH), "-G", "-F", str(config), alias], capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=30, check=False)
    values: dict[str, list[str]] = {}
    for line in done.stdout.splitlines():
        key, _, value = line.partition(" ")
        values.setdefault(key, []).append(value)
    return done.returncode, values, done.stderr


def openssh_view(values: dict[str, list[str]]) -> dict[str, object]:
    def one(key: str) -> str | None:
        return values[key][0] if key in values else None

    timeout = one("connecttimeout")
    known = (one("userknownhostsfile") or "").split()
    global_known = (one("globalknownhostsfile") or "").split()
    jump = one("proxyjump")
    return {
        "hostname": one("hostname"),
        "user": one("user"),
        "port": int(one("port") or 0),
        "identityfile": tuple(values.get("identityfile", [])),
        "identitiesonly": one("identitiesonly") == "yes",
        "proxyjump": tuple(_parse_hop(hop) for hop in jump.split(",")) if jump else (),
        "proxycommand": one("proxycommand"),
        "connecttimeout": None if timeout in (None, "none") else float(timeout),
        "hostkeyalias": one("hostkeyalias"),
        "userknownhostsfile": () if known == ["none"] else tuple(known),
        "globalknownhostsfile": () if global_known == ["none"] else tuple(global_known),
        "stricthostkeychecking": STRICT[one("stricthostkeychecking") or "ask"],
        "hashknownhosts": one("hashknownhosts") == "yes",
        "batchmode": one("batchmode") == "yes",
        "revokedhostkeys": tuple((one("revokedhostkeys") or "").split()),
    }


def torchherd_view(found: HostConfig) -> dict[str, object]:
    return {
        "hostname": found.hostname,
        "user": found.user,
        "port": found.port,
        "identityfile": found.identity_files_as_written,
        "identitiesonly": found.identities_only,
        "proxyjump": found.proxy_jump,
        "proxycommand": found.proxy_command_as_written,
        "connecttimeout": found.connect_timeout,
        "hostkeyalias": found.host_key_alias,
        "userknownhostsfile": found.user_known_hosts_files,
        "globalknownhostsfile": found.global_known_hosts_files,
        "stricthostkeychecking": found.strict_host_key_checking,
        "hashknownhosts": found.hash_known_hosts,
        "batchmode": found.batch_mode,
        "revokedhostkeys": found.revoked_host_keys,
    }


def test_the_corpus_is_large_enough() -> None:
    assert len(CONFIGS) >= 30
    assert sum(len(aliases_of(config)) for config in CONFIGS) >= 60


@pytest.mark.parametrize("config", CONFIGS, ids=[config.stem for config in CONFIGS])
def test_resolution_matches_ssh_g(corpus: Path, config: Path) -> None:
    path = corpus / config.name
    local = Local.of_this_machine()
    for alias in aliases_of(config):
        code, values, stderr = ssh_g(path, alias)
        if expects_error(config):
            assert code != 0, f"ssh accepted {config.name} for {alias}"
            with pytest.raises(SshConfigError):
                lookup(alias, path, local)
            continue
        assert code == 0, f"ssh -G {alias}: {stderr}"
        assert torchherd_view(lookup(alias, path, local)) == openssh_view(values), f"{config.name}: {alias}"
