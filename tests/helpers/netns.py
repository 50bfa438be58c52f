"""Two "machines" on this one: network namespaces joined by a veth pair, each with an address of its own (made
by the test, removed after it; root is needed, which these machines give). A process started in one reaches the
other only through that pair, so an address that works only on loopback fails there.

Plain subprocess and urllib here, as in launch/bench/sglang_standin/processes.py: nothing of grpo_accel's own client."""
import contextlib
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

SUBNET = "10.231.0"  # both ends live inside the namespaces this module makes, nowhere else


class Hosts:
    """Namespaces ``<tag>-0`` .. ``<tag>-1`` with addresses 10.231.0.1 and .2 on interfaces ``<tag>v0``/``v1``."""

    def __init__(self, tag: str) -> None:
        self.tag = tag
        self.names = [f"{tag}-0", f"{tag}-1"]
        self.interfaces = [f"{tag}v0", f"{tag}v1"]
        self.addresses = [f"{SUBNET}.1", f"{SUBNET}.2"]
        self.hostnames = [f"{tag}-host0", f"{tag}-host1"]

    def up(self) -> None:
        self.down()
        for name in self.names:  # each machine's own name resolves to its address (ip netns exec mounts this file)
            folder = Path("/etc/netns") / name
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "hosts").write_text("127.0.0.1 localhost\n" + "".join(
                f"{address} {host}\n" for address, host in zip(self.addresses, self.hostnames)))
        run = lambda *cmd: subprocess.run(["ip", *cmd], check=True, capture_output=True, text=True)  # noqa: E731
        try:
            for name in self.names:
                run("netns", "add", name)
            run("link", "add", self.interfaces[0], "type", "veth", "peer", "name", self.interfaces[1])
            for name, interface, address in zip(self.names, self.interfaces, self.addresses):
                run("link", "set", interface, "netns", name)
                run("-n", name, "addr", "add", f"{address}/24", "dev", interface)
                run("-n", name, "link", "set", interface, "up")
                run("-n", name, "link", "set", "lo", "up")
        except subprocess.CalledProcessError as exc:
            self.down()
            raise RuntimeError(f"cannot make network namespaces ({' '.join(exc.cmd)}: {exc.stderr.strip()}); these "
                               "tests need root and the ip command (iproute2)") from exc

    def down(self) -> None:
        for name in self.names:  # removing a namespace removes its end of the pair, and so the pair
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
            shutil.rmtree(Path("/etc/netns") / name, ignore_errors=True)

    def prefix(self, host: int, gloo_interface: bool = True, hostname: bool = False) -> list[str]:
        """The command prefix that runs a command on ``host``; ``gloo_interface``: with GLOO_SOCKET_IFNAME set to
        that host's interface, as an operator sets it (or NCCL_SOCKET_IFNAME) on a real multi-homed machine;
        ``hostname``: under a host name of its own that resolves to its address, as a real machine's does (torch's
        elastic agent tells the workers of other machines to reach rank 0 by its host name)."""
        env = [f"GLOO_SOCKET_IFNAME={self.interfaces[host]}"] if gloo_interface else []
        named = ["unshare", "--uts", "sh", "-c", f'hostname {self.hostnames[host]} && exec "$@"', "sh"]
        return ["ip", "netns", "exec", self.names[host], *(named if hostname else []), "env", *env]

    def control(self, host: int, url: str, path: str, body: dict | None = None, timeout: float = 60):
        """A stand-in's test-control route, asked from ``host`` (the test's own namespace cannot reach it)."""
        code = ("import json, sys, urllib.request\n"
                "url, body = sys.argv[1], json.loads(sys.argv[2])\n"
                "data = None if body is None else json.dumps(body).encode()\n"
                "req = urllib.request.Request(url, data=data, headers={'Content-Type': 'application/json'})\n"
                "print(urllib.request.urlopen(req, timeout=60).read().decode())\n")
        proc = subprocess.run([*self.prefix(host), sys.executable, "-c", code, url + path, json.dumps(body)],
                              capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"{url}{path} from {self.names[host]}: {proc.stderr[-2000:]}")
        return json.loads(proc.stdout)

    def wait_healthy(self, host: int, url: str, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.control(host, url, "/_standin/counts")
                return
            except RuntimeError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.3)


@contextlib.contextmanager
def two_hosts(tag: str = "grpoacc"):  # one name: a run killed midway leaves nothing the next cannot remove
    hosts = Hosts(tag)
    hosts.up()
    try:
        yield hosts
    finally:
        hosts.down()
