"""Two hosts on one machine, for real: each node is a network namespace with its own address,
joined to the other by a veth pair, with its own host name (a UTS namespace) and its own mount
namespace. The nodes' traffic stays inside these namespaces, on addresses from the benchmarking
range 198.18.0.0/15; nothing is reachable from them but each other.

    with TwoHosts(tmp) as cluster:            # creates the namespaces; removes them on exit
        cluster.popen("node2", ["python", ...], env)
        cluster.shared                        # the shared directory, at the same path on every node

What a single machine hides and this shows:
  * each node's /etc/hosts maps its own name to 127.0.1.1, as Debian and Ubuntu install it, and
    the other node's name to its 198.18 address: a rank that binds to what its host name
    resolves to is unreachable from the other node;
  * the interface is `cl0` on both nodes, and loopback is the only other one;
  * the shared directory is a bind mount, in each node's mount namespace, of one storage
    directory; outside the namespaces the mount point stays empty, so every file the test finds
    in storage was written through a node's own mount.

Needs root, `ip` (iproute2) and `unshare`/`mount` (util-linux); ``unavailable()`` says why not.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
from pathlib import Path

NODES = ("node1", "node2")
ADDRESSES = {"node1": "198.18.0.1", "node2": "198.18.0.2"}
INTERFACE = "cl0"

# Runs inside `ip netns exec NS unshare --uts --mount`: name the host, give it its /etc/hosts and
# the shared mount, then become the command.
ENTER = 'hostname "$1" && mount --bind "$2" /etc/hosts && mount --bind "$3" "$4" && shift 4 && exec "$@"'


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=60)


def unavailable() -> str | None:
    """Why two namespaced hosts cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "unshare", "mount"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (iproute2 / util-linux)"
    probe = f"admin-ds-probe-{secrets.token_hex(3)}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


class TwoHosts:
    def __init__(self, tmp: Path) -> None:
        tag = secrets.token_hex(3)  # other test sessions may run beside this one
        self.netns = {node: f"admin-ds-{tag}-{node}" for node in NODES}
        self.veth = {"node1": f"ads{tag}a", "node2": f"ads{tag}b"}
        self.storage = tmp / "storage"  # what the shared file system holds
        self.shared = tmp / "shared"  # where every node sees it
        self.hosts = {node: tmp / f"hosts.{node}" for node in NODES}
        self.enter = tmp / "enter_node"  # `enter_node NODE COMMAND...`, also the mpirun launch agent

    def __enter__(self) -> "TwoHosts":
        self.storage.mkdir()
        self.shared.mkdir()
        try:
            for node in NODES:
                _ip("netns", "add", self.netns[node])
            _ip("link", "add", self.veth["node1"], "type", "veth", "peer", "name", self.veth["node2"])
            for node in NODES:
                ns = self.netns[node]
                _ip("link", "set", self.veth[node], "netns", ns)
                _ip("-n", ns, "link", "set", self.veth[node], "name", INTERFACE)
                _ip("-n", ns, "addr", "add", f"{ADDRESSES[node]}/24", "dev", INTERFACE)
                _ip("-n", ns, "link", "set", INTERFACE, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
                others = "".join(f"{ADDRESSES[n]} {n}\n" for n in NODES if n != node)
                self.hosts[node].write_text(f"127.0.0.1 localhost\n127.0.1.1 {node}\n{others}")
        except BaseException:
            self.__exit__()
            raise
        cases = "".join(f'    {node}) ns={self.netns[node]} ;;\n' for node in NODES)
        self.enter.write_text(
            "#!/bin/sh\n# Run a command on a node: its network, host name, /etc/hosts and shared mount.\n"
            f'node=$1; shift\ncase "$node" in\n{cases}    *) echo "no such node: $node" >&2; exit 2 ;;\nesac\n'
            f'hosts={self.hosts["node1"].parent}/hosts.$node\n'
            f"exec ip netns exec $ns unshare --uts --mount -- sh -c '{ENTER}' sh \"$node\" \"$hosts\" "
            f'{self.storage} {self.shared} "$@"\n')
        self.enter.chmod(0o755)
        return self

    def popen(self, node: str, cmd: list, env: dict, log: Path) -> subprocess.Popen:
        """``cmd`` on ``node``, its output (both streams) into ``log``."""
        with open(log, "w") as out:  # the child has its own copy of the descriptor
            return subprocess.Popen([str(self.enter), node, *map(str, cmd)], env=env, stdout=out,
                                    stderr=subprocess.STDOUT)

    def agent(self) -> str:
        """An rsh agent for mpirun: `agent HOST COMMAND-WORDS...`, as ssh would be called."""
        agent = self.enter.with_name("mpirun_agent")
        agent.write_text(f'#!/bin/sh\nnode=$1; shift\nexec {self.enter} "$node" sh -c "$*"\n')
        agent.chmod(0o755)
        return str(agent)

    def __exit__(self, *exc) -> None:
        for node in NODES:  # whatever is still running in our namespaces is ours
            pids = _ip("netns", "pids", self.netns[node], check=False).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            _ip("netns", "del", self.netns[node], check=False)  # takes its end of the veth pair along
        _ip("link", "del", self.veth["node1"], check=False)  # in case it never moved
