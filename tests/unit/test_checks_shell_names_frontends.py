"""Pure analyses: slow login shell (ssh), every node's name on the master (hostname),
ufw and firewalld read as firewall evidence."""

from __future__ import annotations

from support.analysis import facts, observed
from torchherd.checks.analysis import firewall, frontends, hostname, ssh
from torchherd.checks.model import Observed

UFW_ACTIVE = """Status: active
Logging: on (low)
Default: deny (incoming), allow (outgoing), disabled (routed)
New profiles: skip

To                         Action      From
--                         ------      ----
22/tcp                     ALLOW IN    Anywhere
29500/tcp                  ALLOW IN    10.0.0.0/24
8080                       DENY IN     192.168.9.9
29000:29600/tcp            ALLOW IN    Anywhere
Anywhere                   ALLOW IN    10.0.0.2
22/tcp (v6)                ALLOW IN    Anywhere (v6)
53                         ALLOW OUT   Anywhere
"""

FIREWALLD = """public (active)
  target: default
  icmp-block-inversion: no
  interfaces: eth0
  sources: 
  services: dhcpv6-client ssh
  ports: 29500/tcp
  protocols: 
  forward: yes
  masquerade: no
  forward-ports: 
  source-ports: 
  icmp-blocks: 
  rich rules: 
\trule family="ipv4" source address="10.0.0.0/24" accept
\trule family="ipv6" source address="fd00::/64" port port="29500" protocol="tcp" accept
"""


def test_slow_shell_warns_with_the_time() -> None:
    seen = observed()
    seen.shell_seconds = {"node0": 0.04, "node1": 3.7}
    results = {result.node: result for result in ssh.analyse(seen)}
    assert results["node0"].status == "pass" and "0.04 s" in results["node0"].summary
    assert results["node1"].status == "warn"
    assert "took 3.7 s" in results["node1"].summary and "~/.bashrc" in results["node1"].fix


def test_a_shell_slow_only_because_the_node_is_busy_passes_saying_so() -> None:
    busy = {"pressure": 97.0, "load": 30.0, "cpus": 2}
    seen = observed(node0=facts("node0", shell_cpu_seconds=0.15, cpu_contention=busy),
                    node1=facts("node1", shell_cpu_seconds=2.5, cpu_contention=busy))
    seen.shell_seconds = {"node0": 4.2, "node1": 4.2}
    results = {result.node: result for result in ssh.analyse(seen)}
    assert results["node0"].status == "pass"
    assert "used 0.15 s of CPU, while the node's CPUs were busy (a task waited for a CPU 97% of the last 10 s)" \
        in results["node0"].summary
    assert results["node1"].status == "warn"  # its startup files burn the CPU themselves


def test_without_pressure_figures_the_load_tells_a_busy_node() -> None:
    idle, loaded = {"load": 0.5, "cpus": 8}, {"load": 9.0, "cpus": 8}
    seen = observed(node0=facts("node0", shell_cpu_seconds=0.1, cpu_contention=idle),
                    node1=facts("node1", shell_cpu_seconds=0.1, cpu_contention=loaded))
    seen.shell_seconds = {"node0": 3.0, "node1": 3.0}
    results = {result.node: result for result in ssh.analyse(seen)}
    assert results["node0"].status == "warn"  # idle, yet slow: the startup files wait on something
    assert results["node1"].status == "pass" and "load 9.0 on 8 CPUs" in results["node1"].summary


def test_a_shell_slow_only_among_every_nodes_logins_passes_once_timed_again() -> None:
    seen = observed()  # no pressure or load figures: only the second timing can tell
    seen.shell_seconds = {"node0": 3.4, "node1": 3.6}
    seen.shell_alone = {"node0": 0.31, "node1": 3.1}
    results = {result.node: result for result in ssh.analyse(seen)}
    assert results["node0"].status == "pass"
    assert "took 3.4 s to start among every node's logins, 0.31 s timed again after them" in results["node0"].summary
    assert results["node1"].status == "warn"
    assert "took 3.6 s over SSH (over 2 s), and 3.1 s timed again after the other nodes' logins" \
        in results["node1"].summary


def test_slow_shells_are_timed_again_and_only_those() -> None:
    busy = {"pressure": 97.0, "load": 30.0, "cpus": 2}
    for exempt, expected in ((False, ["node1"]), (True, [])):
        seen = observed(node1=facts("node1", shell_cpu_seconds=0.1, cpu_contention=busy)) if exempt else observed()
        seen.shell_seconds = {"node0": 0.05, "node1": 3.0}
        assert sorted(_timed_again(seen)) == expected  # a busy node explains itself: not timed again


def _timed_again(seen: Observed) -> dict[str, float]:
    from torchherd.checks.runner import confirm_slow_shells
    from torchherd.transport.local import LocalConnector

    connector = LocalConnector()
    connections = {host.name: connector.connect(host) for host in seen.inventory.hosts}
    try:
        confirm_slow_shells(seen, connections)
    finally:
        for connection in connections.values():
            connection.close()
    assert all(0 < seconds < 2.0 for seconds in seen.shell_alone.values())
    return seen.shell_alone


def test_shell_not_timed_still_passes() -> None:
    assert {result.status for result in ssh.analyse(observed())} == {"pass"}


def test_every_name_resolves_on_the_master() -> None:
    seen = observed()
    seen.connected = {"node0": {"resolve": {"node1": {"addresses": ["10.0.0.2"]}}}}
    results = {result.node: result for result in hostname.analyse(seen)}
    assert results["node0"].status == "pass" and "every node's hostname resolves here" in results["node0"].summary


def test_a_worker_name_unresolvable_on_the_master_fails_there() -> None:
    seen = observed()
    seen.connected = {"node0": {"resolve": {"node1": {"error": "Name or service not known"}}}}
    result = {result.node: result for result in hostname.analyse(seen)}["node0"]
    assert result.status == "fail"
    assert "cannot resolve node1's hostname node1 (Name or service not known)" in result.summary
    assert "`10.0.0.2 node1`" in result.fix and "/etc/hosts on node0" in result.fix


def test_a_worker_name_resolving_elsewhere_on_the_master_fails() -> None:
    seen = observed()
    seen.connected = {"node0": {"resolve": {"node1": {"addresses": ["10.0.0.99"]}}}}
    result = {result.node: result for result in hostname.analyse(seen)}["node0"]
    assert result.status == "fail" and "to 10.0.0.99, not an address of node1" in result.summary


def test_parse_ufw_verbose() -> None:
    state = frontends.parse_ufw(UFW_ACTIVE)
    assert state.active and state.default.startswith("deny (incoming)")
    assert len(state.rules) == 7
    assert state.rules[1] == frontends.UfwRule("29500/tcp", "ALLOW IN", "10.0.0.0/24")


def test_relevant_ufw_rules_on_the_master_and_on_a_worker() -> None:
    state = frontends.parse_ufw(UFW_ACTIVE)
    on_master = [rule.text() for rule in frontends.relevant_ufw_rules(state, 29500, ["10.0.0.2"])]
    assert on_master == ["29500/tcp ALLOW IN 10.0.0.0/24", "29000:29600/tcp ALLOW IN Anywhere",
                         "Anywhere ALLOW IN 10.0.0.2"]
    on_worker = [rule.text() for rule in frontends.relevant_ufw_rules(state, None, ["10.0.0.1"])]
    assert on_worker == ["29500/tcp ALLOW IN 10.0.0.0/24"]


def test_describe_ufw_inactive_and_active() -> None:
    assert frontends.describe_ufw("Status: inactive\n", 29500, []) == "ufw inactive"
    text = frontends.describe_ufw(UFW_ACTIVE, 29500, ["10.0.0.2"])
    assert text.startswith("ufw active (default: deny (incoming)")
    assert "`29500/tcp ALLOW IN 10.0.0.0/24`" in text and "8080" not in text


def test_parse_firewalld_list_all() -> None:
    (zone,) = frontends.parse_firewalld(FIREWALLD)
    assert zone.name == "public" and zone.active
    assert zone.settings["ports"] == "29500/tcp" and zone.settings["services"] == "dhcpv6-client ssh"
    assert zone.settings["sources"] == ""
    assert zone.rich_rules[0] == 'rule family="ipv4" source address="10.0.0.0/24" accept'
    assert len(zone.rich_rules) == 2
    text = frontends.describe_firewalld(FIREWALLD)
    assert "zone public (active): target default, interfaces eth0, services dhcpv6-client ssh" in text
    assert "ports 29500/tcp" in text and "sources" not in text


def test_firewall_summary_reports_ufw_and_firewalld() -> None:
    tools = {"iptables": {"code": 0, "out": "-P INPUT ACCEPT\n"}, "ufw": {"code": 0, "out": UFW_ACTIVE},
             "firewalld": {"code": 0, "out": FIREWALLD}}
    seen = observed(node0=facts("node0", firewall={"euid": 0, "tools": tools}))
    result = {result.node: result for result in firewall.analyse(seen)}["node0"]
    assert result.status == "pass"
    assert "ufw active (default: deny (incoming)" in result.summary
    assert "`29500/tcp ALLOW IN 10.0.0.0/24`" in result.summary and "zone public (active)" in result.summary


def test_firewall_failure_keeps_the_ufw_evidence() -> None:
    rules = "-P INPUT ACCEPT\n-A INPUT -p tcp -m tcp --dport 29500 -j DROP\n"
    tools = {"iptables": {"code": 0, "out": rules}, "ufw": {"code": 0, "out": UFW_ACTIVE}}
    seen = observed(node0=facts("node0", firewall={"euid": 0, "tools": tools}))
    result = {result.node: result for result in firewall.analyse(seen)}["node0"]
    assert result.status == "fail" and "--dport 29500 -j DROP" in result.summary and "ufw active" in result.summary
