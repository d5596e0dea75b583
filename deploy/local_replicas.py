"""Three treeserve replicas behind HAProxy on this machine's loopback: the deployment of
docker/docker-compose.replicas.yml without containers, using deploy/haproxy/haproxy.cfg as it
is (its addresses come from the environment). tests/deploy/proxy_e2e_test.py and
bench/serving/replicas.sh run on it; by hand:

    python3 deploy/local_replicas.py build/bin/treeserve [--balance hash|random|roundrobin]
        [-- extra treeserve arguments]

prints the proxy's address (and each replica's) and runs until interrupted. Each replica is
`treeserve --replica-id rN` (CPU backend unless the extra arguments say otherwise) with gRPC
and metrics on free loopback ports. Needs haproxy (Debian: apt-get install haproxy).
Standard library only.
"""
import csv
import io
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
HAPROXY_CFG = os.path.join(HERE, "haproxy", "haproxy.cfg")
NAMES = ["r1", "r2", "r3"]  # haproxy.cfg names three replicas


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url, timeout=5):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def wait_for(what, cond, timeout, interval=0.1):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return
        time.sleep(interval)
    raise RuntimeError("timed out after %.0f s waiting for %s" % (timeout, what))


def find_haproxy():
    return shutil.which("haproxy", path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")


class Replica:
    """One `treeserve --replica-id NAME` process on free loopback ports."""

    def __init__(self, binary, name, workdir, extra_args=()):
        self.name = name
        self.grpc_port, self.metrics_port = free_port(), free_port()
        self.address = "127.0.0.1:%d" % self.grpc_port
        self.log = os.path.join(workdir, name + ".log")
        args = [binary, "--replica-id", name, "--listen", self.address,
                "--metrics-listen", "127.0.0.1:%d" % self.metrics_port]
        if "--backend" not in extra_args:
            args += ["--backend", "cpu"]
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(args + list(extra_args), stdout=log,
                                         stderr=subprocess.STDOUT)

    def ready(self):
        if self.proc.poll() is not None:
            raise RuntimeError("replica %s exited (%s):\n%s" % (self.name, self.proc.returncode,
                                                               self.tail()))
        with open(self.log) as f:
            return " ready: " in f.read()

    def tail(self, lines=20):
        with open(self.log) as f:
            return "".join(f.readlines()[-lines:])

    def metrics(self):
        """{name: value} of the replica's Prometheus text, label sets summed per name."""
        out = {}
        text = http_get("http://127.0.0.1:%d/metrics" % self.metrics_port)
        for m in re.finditer(r"^([a-zA-Z_:][\w:]*)(?:\{[^}]*\})? (\S+)$", text, re.M):
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
        return out


class ReplicaSet:
    """Three replicas and HAProxy with the repository's config. balance: TREESERVE_BALANCE
    (hash, random or roundrobin). Use as a context manager; stop() ends every process."""

    def __init__(self, binary, workdir=None, balance="hash", extra_args=(), log=print):
        self.binary, self.balance, self.extra_args, self.say = binary, balance, extra_args, log
        self.own_dir = workdir is None
        self.workdir = workdir or tempfile.mkdtemp(prefix="treeserve-replicas-")
        os.makedirs(self.workdir, exist_ok=True)
        self.replicas, self.proxy = [], None

    def __enter__(self):
        try:
            self.start()
        except BaseException:
            self.stop()
            self.cleanup()
            raise
        return self

    def __exit__(self, *exc):
        self.stop()

    def by_name(self, name):
        return next(r for r in self.replicas if r.name == name)

    def start(self, ready_timeout=120):
        haproxy = find_haproxy()
        if not haproxy:
            raise RuntimeError("haproxy is not installed (Debian: apt-get install haproxy)")
        for n in NAMES:
            self.replicas.append(Replica(self.binary, n, self.workdir, self.extra_args))
        for r in self.replicas:
            wait_for("replica %s to load its model" % r.name, r.ready, ready_timeout)
        self.listen = "127.0.0.1:%d" % free_port()
        self.stats_port = free_port()
        env = dict(os.environ, TREESERVE_PROXY_LISTEN=self.listen,
                   TREESERVE_PROXY_STATS="127.0.0.1:%d" % self.stats_port,
                   TREESERVE_BALANCE=self.balance)
        for i, r in enumerate(self.replicas, 1):
            env["TREESERVE_REPLICA_%d" % i] = r.address
        self.proxy_log = os.path.join(self.workdir, "haproxy.log")
        with open(self.proxy_log, "w") as log:
            self.proxy = subprocess.Popen([haproxy, "-db", "-f", HAPROXY_CFG], env=env,
                                          stdout=log, stderr=subprocess.STDOUT)
        wait_for("HAProxy's health checks to pass on every replica", self.all_up, 30)

    def servers(self):
        """{server: (status, last check)} of the hashing backend, from HAProxy's stats CSV."""
        if self.proxy.poll() is not None:
            raise RuntimeError("haproxy exited (%s)" % self.proxy.returncode)
        text = http_get("http://127.0.0.1:%d/stats;csv" % self.stats_port).lstrip("# ")
        return {row["svname"]: (row["status"], row["check_status"])
                for row in csv.DictReader(io.StringIO(text))
                if row["pxname"] == "treeserve" and row["svname"] not in ("FRONTEND", "BACKEND")}

    def all_up(self):
        try:
            s = self.servers()
        except OSError:  # not listening yet
            return False
        return len(s) == len(NAMES) and all(v == ("UP", "L7OK") for v in s.values())

    def kill(self, name):
        """SIGKILL one replica; returns once it has exited."""
        r = self.by_name(name)
        r.proc.send_signal(signal.SIGKILL)
        r.proc.wait(10)

    def stop(self):
        """SIGTERM the replicas (each must drain and exit 0; returns those that did not) and
        end HAProxy."""
        unclean = []
        for r in self.replicas:
            if r.proc.poll() is None:
                r.proc.terminate()
        for r in self.replicas:
            try:
                if r.proc.wait(30) != 0 and r.proc.returncode != -signal.SIGKILL:
                    unclean.append(r.name)
            except subprocess.TimeoutExpired:
                r.proc.kill()
                r.proc.wait()
                unclean.append(r.name)
        if self.proxy and self.proxy.poll() is None:
            self.proxy.terminate()
            try:
                self.proxy.wait(10)
            except subprocess.TimeoutExpired:
                self.proxy.kill()
                self.proxy.wait()
        return unclean

    def logs(self, lines=30):
        """The last lines of every log, for a failure report."""
        out = []
        for name in sorted(os.listdir(self.workdir)):
            if name.endswith(".log"):
                with open(os.path.join(self.workdir, name)) as f:
                    out.append("== %s\n%s" % (name, "".join(f.readlines()[-lines:])))
        return "\n".join(out)

    def cleanup(self):
        if self.own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)


def main(argv):
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("binary", help="the treeserve binary (e.g. build/bin/treeserve)")
    ap.add_argument("--balance", default="hash", choices=["hash", "random", "roundrobin"])
    ap.add_argument("extra", nargs="*", help="more treeserve arguments (after --)")
    args = ap.parse_args(argv)
    rs = ReplicaSet(args.binary, balance=args.balance, extra_args=args.extra)
    try:
        rs.start()
        print("proxy: %s (stats http://127.0.0.1:%d/stats), balance %s" % (
            rs.listen, rs.stats_port, args.balance))
        for r in rs.replicas:
            print("  %s: %s, metrics http://127.0.0.1:%d/metrics" % (r.name, r.address,
                                                                     r.metrics_port))
        print("logs in %s; Ctrl-C stops" % rs.workdir)
        signal.signal(signal.SIGTERM, signal.default_int_handler)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        rs.stop()
        rs.cleanup()


if __name__ == "__main__":
    main(sys.argv[1:])
