"""transport.sshconfig: properties of the reader (hypothesis), and what the ``ssh -G``
corpus cannot show: tokens expanded into paths, a chosen home, Match exec's
commands, ``-l``/``-p``/``-J`` given first, Include loops."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from torchherd.transport import sshconfig
from torchherd.transport.sshconfig import Jump, Local, SshConfigError, expand_tokens, lookup, parse_jump, parse_time
from torchherd.transport.sshlines import match_hostname, match_pattern, split_args, split_line

NAMES = st.from_regex(r"[a-z][a-z0-9-]{0,12}", fullmatch=True)
WORDS = st.text(st.characters(blacklist_categories=("Cs", "Cc")), min_size=1, max_size=20)


def local(tmp_path: Path, ran: list[str] | None = None, exit_zero: bool = True) -> Local:
    def run(command: str) -> bool:
        if ran is not None:
            ran.append(command)
        return exit_zero

    return Local(user="me", home=str(tmp_path), uid=1000, hostname="laptop.example", environ={"KH": "/env"}, run=run)


def resolve(tmp_path: Path, text: str, alias: str, **kwargs: object) -> sshconfig.HostConfig:
    config = tmp_path / "config"
    config.write_text(text)
    chosen = kwargs.pop("local", None) or local(tmp_path)
    return lookup(alias, config, chosen, **kwargs)  # type: ignore[arg-type]


# ---------------------------------------------------------------- properties


@given(st.lists(WORDS.filter(lambda word: "\n" not in word and "\r" not in word), min_size=1, max_size=6))
def test_quoted_words_split_back_into_themselves(words: list[str]) -> None:
    quoted = " ".join('"' + word.replace("\\", "\\\\").replace('"', '\\"') + '"' for word in words)
    assert split_args(quoted) == words


@given(st.sampled_from(["Port", "port", "PORT"]), st.sampled_from([" ", "=", " = ", "\t", " =", "= "]),
       st.integers(1, 65535))
def test_keyword_and_value_separate_by_space_or_one_equals(keyword: str, separator: str, port: int) -> None:
    assert split_line(f"  {keyword}{separator}{port}  ") == ("port", str(port))


@given(st.text(st.sampled_from("ab.-"), max_size=12), st.text(st.sampled_from("ab.-"), max_size=12))
def test_star_matches_any_text_and_a_literal_pattern_only_itself(prefix: str, text: str) -> None:
    assert match_pattern(text, "*")
    assert match_pattern(prefix + text, prefix + "*")
    assert match_pattern(text, text)
    assert match_pattern(text, text + "x") is False


@given(NAMES, st.lists(NAMES, max_size=4), st.lists(NAMES, max_size=4))
def test_a_matching_negation_wins_wherever_it_stands(host: str, before: list[str], after: list[str]) -> None:
    patterns = ",".join(before + ["!" + host] + after + ["*"])
    assert match_hostname(host, patterns) == -1
    assert match_hostname(host.upper(), host.upper()) == 1


@given(st.lists(st.tuples(st.sampled_from(["*", "node*", "node1", "!node1", "other"]), NAMES), min_size=1,
                max_size=6))
def test_the_first_block_that_matches_sets_the_value(tmp_path_factory: pytest.TempPathFactory,
                                                     blocks: list[tuple[str, str]]) -> None:
    tmp_path = tmp_path_factory.mktemp("first")
    text = "".join(f"Host {pattern}\n    User {user}\n" for pattern, user in blocks)
    expected = next((user for pattern, user in blocks
                     if pattern != "!node1" and match_pattern("node1", pattern)), "me")
    assert resolve(tmp_path, text, "node1").user == expected


@given(st.lists(st.tuples(NAMES, st.integers(1, 65535)), min_size=1, max_size=5), st.integers(0, 5))
def test_an_included_file_reads_as_if_written_in_place(tmp_path_factory: pytest.TempPathFactory,
                                                         blocks: list[tuple[str, int]], cut: int) -> None:
    tmp_path = tmp_path_factory.mktemp("include")
    lines = [f"Host {name}\n    Port {port}\n" for name, port in blocks]
    cut = min(cut, len(lines))
    (tmp_path / "part.conf").write_text("".join(lines[cut:]))
    inline = tmp_path / "inline"
    inline.write_text("".join(lines))
    split = tmp_path / "split"
    split.write_text("".join(lines[:cut]) + f"Host *\nInclude {tmp_path}/part.conf\n")
    for name, _ in blocks:
        assert lookup(name, split, local(tmp_path)).port == lookup(name, inline, local(tmp_path)).port


@given(st.text(st.characters(blacklist_characters="%"), max_size=30))
def test_text_without_tokens_is_unchanged_and_a_doubled_percent_is_one(text: str) -> None:
    assert expand_tokens(text, {}, "test") == text
    assert expand_tokens(text + "%%", {"h": "x"}, "test") == text + "%"


@given(st.lists(st.tuples(st.integers(0, 99), st.sampled_from(["s", "m", "h", "d", "w", "M", "H"])), min_size=1,
                max_size=4), st.booleans())
def test_time_values_add_up(parts: list[tuple[int, str]], bare_last: bool) -> None:
    if bare_last:  # a number without a unit is seconds; only the last part can be one
        parts[-1] = (parts[-1][0], "")
    text = "".join(f"{number}{unit}" for number, unit in parts)
    assert parse_time(text) == sum(number * sshconfig.TIME_UNITS[unit.lower()] for number, unit in parts)


@given(st.lists(st.tuples(NAMES, st.one_of(st.none(), NAMES), st.one_of(st.none(), st.integers(1, 65535))),
                min_size=1, max_size=4))
def test_jump_hops_print_and_parse_back(hops: list[tuple[str, str | None, int | None]]) -> None:
    jumps = tuple(Jump(host, user, port) for host, user, port in hops)
    assert parse_jump(",".join(str(jump) for jump in jumps), {}, "test") == jumps


# ---------------------------------------------------------------- cases


def test_paths_expand_home_tokens_and_environment(tmp_path: Path) -> None:
    found = resolve(tmp_path, "Host gpu\n  HostName 10.0.0.9\n  User alice\n  Port 2222\n"
                              "  IdentityFile ~/.ssh/%r_%h_%p\n  IdentityFile ${KH}/key-%u-%L-%n\n"
                              "  UserKnownHostsFile ~/kh %d/%C ${KH}/%k\n", "gpu")
    assert found.identity_files == (f"{tmp_path}/.ssh/alice_10.0.0.9_2222", "/env/key-me-laptop-gpu")
    assert found.identity_files_as_written == ("~/.ssh/%r_%h_%p", "${KH}/key-%u-%L-%n")
    digest = hashlib.sha1(b"laptop.example10.0.0.92222alice").hexdigest()
    assert found.user_known_hosts_files == (f"{tmp_path}/kh", f"{tmp_path}/{digest}", "/env/gpu")
    assert found.host_key_name == "[10.0.0.9]:2222"


def test_an_unset_variable_or_an_unknown_token_is_an_error_naming_the_option(tmp_path: Path) -> None:
    with pytest.raises(SshConfigError, match=r"IdentityFile: environment variable \$\{NOPE\} is not set"):
        resolve(tmp_path, "IdentityFile ${NOPE}/key\n", "x")
    with pytest.raises(SshConfigError, match="ProxyCommand: unknown token '%u'"):
        resolve(tmp_path, "ProxyCommand nc %u %p\n", "x")


def test_proxy_command_tokens_are_the_target_s(tmp_path: Path) -> None:
    found = resolve(tmp_path, "Host db\n  HostName db.internal\n  User ops\n  Port 2200\n"
                              "  ProxyCommand ssh -W %h:%p -l %r gw # %n\n", "db")
    assert found.proxy_command == "ssh -W db.internal:2200 -l ops gw # db"


def test_command_line_values_come_first_and_decide_matches(tmp_path: Path) -> None:
    text = "Match user root\n  Port 2001\nHost *\n  User config-user\n  Port 2002\n  ProxyJump j1\n"
    assert (resolve(tmp_path, text, "x").user, resolve(tmp_path, text, "x").port) == ("config-user", 2002)
    given = resolve(tmp_path, text, "x", user="root", jump="a,b")
    assert (given.user, given.port, given.proxy_jump) == ("root", 2001, (Jump("a"), Jump("b")))
    assert resolve(tmp_path, text, "x", port=2200).port == 2200


def test_match_exec_runs_its_command_with_tokens_only_when_needed(tmp_path: Path) -> None:
    ran: list[str] = []
    text = ('Match originalhost other exec "never %h"\n  User no\n'
            'Match exec "probe %n %h %p %r %u"\n  User yes\n')
    found = resolve(tmp_path, text, "gpu", local=local(tmp_path, ran))
    assert found.user == "yes" and ran == ["probe gpu gpu 22 me me"]
    assert resolve(tmp_path, text, "gpu", local=local(tmp_path, exit_zero=False)).user == "me"


def test_include_is_relative_to_dot_ssh_and_a_loop_is_an_error(tmp_path: Path) -> None:
    (tmp_path / ".ssh").mkdir()
    (tmp_path / ".ssh" / "extra.conf").write_text("Host gpu-*\n  User from-dot-ssh\n")
    assert resolve(tmp_path, "Include extra.conf\n", "gpu-1").user == "from-dot-ssh"
    (tmp_path / "loop.conf").write_text(f"Include {tmp_path}/loop.conf\n")
    with pytest.raises(SshConfigError, match="nested too deeply"):
        resolve(tmp_path, f"Include {tmp_path}/loop.conf\n", "x")


def test_without_a_file_the_user_config_then_the_system_one_are_read(tmp_path: Path) -> None:
    (tmp_path / ".ssh").mkdir()
    (tmp_path / ".ssh" / "config").write_text("Host a\n  User from-user-file\n")
    system = tmp_path / "ssh_config"
    system.write_text("Host *\n  User from-system\n  HashKnownHosts yes\n")
    found = lookup("a", None, local(tmp_path), system_file=str(system))
    assert (found.user, found.hash_known_hosts) == ("from-user-file", True)
    assert lookup("b", None, local(tmp_path), system_file=str(system)).user == "from-system"
    with pytest.raises(SshConfigError, match="bad include path"):
        system.write_text("Include ~/x.conf\n")
        lookup("b", None, local(tmp_path), system_file=str(system))


def test_a_named_file_that_is_missing_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(SshConfigError, match="ssh_config file not found"):
        lookup("x", tmp_path / "missing", local(tmp_path))


def test_settings_remember_their_file_and_line(tmp_path: Path) -> None:
    found = resolve(tmp_path, "# c\nHost *\n  StrictHostKeyChecking no\n", "x")
    assert found.strict_host_key_checking == "no"
    assert found.settings["stricthostkeychecking"].where == f"{tmp_path / 'config'} line 3"


@pytest.mark.parametrize("text", ["a@", "host:0", "host:x", "[fe80::1", "ssh://a/path", "a b", "a;b"])
def test_malformed_jump_hops_are_refused(text: str) -> None:
    with pytest.raises(SshConfigError, match="invalid ProxyJump hop"):
        parse_jump(text, {}, "test")
