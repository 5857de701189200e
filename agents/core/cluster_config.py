"""The ``[cluster]`` config section: which servers a run's network is spread over, and how
its hosts and switches are placed on them (Mininet Cluster Edition's placers,
``topo.placement``).

One server (the default, ``["localhost"]``) is a run on this machine only, exactly as
without the section. The names are checked here; whether a pin names a node or role the
network has is checked when the network is placed (``topo.placement.place``): the core
cannot see the shapes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from agents.core.checks import check as _check

# switchbin: switches spread evenly over the servers, every host on its switch's server
#   (fewest links that cross servers); roundrobin: every node on the next server in turn;
#   random: every node on a server drawn from a generator seeded with run.seed.
PLACEMENTS = ("switchbin", "roundrobin", "random")
SERVERS_MAX = 64
# A DNS name or a dotted IPv4 address; ssh and Mininet's findServerIP take both.
_SERVER = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,62}[A-Za-z0-9])?"
                     r"(\.[A-Za-z0-9]([A-Za-z0-9-]{0,62}[A-Za-z0-9])?)*$")
_IPV4 = re.compile(r"^\d{1,3}(\.\d{1,3}){3}$")
_USER = re.compile(r"^[a-z_][a-z0-9_-]{0,31}$")
# A pin's key: a host or switch name (ps, w3, gbsw1) or a role name (worker, stage, expert).
_PIN_KEY = re.compile(r"^[a-z][a-z0-9_]{0,63}$")


def _server_ok(name: str) -> bool:
    if _IPV4.match(name):
        return all(0 <= int(p) <= 255 for p in name.split("."))
    return bool(_SERVER.match(name))


@dataclass(frozen=True)
class ClusterConfig:
    # The machines the network is spread over, by DNS name or IPv4 address; "localhost" is
    # this one. More servers, more hosts fit, more links cross servers through tunnels.
    servers: tuple[str, ...] = ("localhost",)
    user: str = "root"                # ssh user on every remote server (needs root there)
    key_path: str = ""                # ssh private key for the remote servers; "" = ssh's default
    ssh_config: str = ""              # an ssh_config file (ssh -F): known hosts, ports; "" = ssh's own
    placement: str = "switchbin"      # switchbin, roundrobin or random (PLACEMENTS)
    # Node or role -> server, placed before the placer runs, e.g. {ps = "localhost",
    # worker = "10.99.0.2"}: a node name pins that node, a role name every host of the
    # role. A pinned switch takes its unpinned hosts along under switchbin.
    pins: dict[str, str] = field(default_factory=dict)

    @property
    def remote(self) -> bool:
        """True when some node may land on a server other than this machine."""
        return self.servers != ("localhost",)

    def validate(self, p: str) -> None:
        _check(1 <= len(self.servers) <= SERVERS_MAX, f"{p}.servers", list(self.servers),
               f"must list 1..{SERVERS_MAX} servers")
        for i, s in enumerate(self.servers):
            _check(isinstance(s, str) and _server_ok(s), f"{p}.servers[{i}]", s,
                   "must be a host name or an IPv4 address")
        dup = sorted({s for s in self.servers if self.servers.count(s) > 1})
        _check(not dup, f"{p}.servers", list(self.servers),
               f"must not repeat a server (repeated: {', '.join(map(str, dup))})")
        _check(bool(_USER.match(self.user)), f"{p}.user", self.user,
               "must be a user name (lower case letters, digits, '_', '-')")
        for name in ("key_path", "ssh_config"):
            value = getattr(self, name)
            _check("\n" not in value, f"{p}.{name}", value, "must be a file path or empty")
        _check(self.placement in PLACEMENTS, f"{p}.placement", self.placement,
               f"must be one of {', '.join(PLACEMENTS)}")
        for key, server in self.pins.items():
            _check(bool(_PIN_KEY.match(key)), f"{p}.pins", key,
                   "keys must be a host, switch or role name")
            _check(server in self.servers, f"{p}.pins.{key}", server,
                   f"must be one of {p}.servers ({', '.join(self.servers)})")
