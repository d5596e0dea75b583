"""Three treeserve replicas behind HAProxy, with the repository's own config
(deploy/haproxy/haproxy.cfg, through deploy/local_replicas.py), all on loopback:

 1. HAProxy's gRPC health check passes on each replica (stats page: UP, L7OK);
 2. through the proxy, with the Python client (which sets x-treeserve-route), a tree is
    created, forked, generated on, pruned, read and deleted; every answer carries the
    x-treeserve-replica of the replica its id names; trees land on every replica; prompts
    sharing their first 256 bytes land on one replica and reuse its cache; no replica counts
    a misrouted call;
 3. the same calls through nginx (deploy/nginx/nginx.conf, addresses rewritten to loopback)
    reach the tree's replica too;
 4. one replica is killed (SIGKILL); once HAProxy has taken it out, calls on its trees fail
    with FAILED_PRECONDITION naming it, the other replicas' trees still work, and 20 new trees
    with varied prompts are all served; the misroute counters count exactly the calls on the
    dead replica's trees.

usage: proxy_e2e_test.py TREESERVE_BINARY SOURCE_DIR
Exits 77 (ctest: skipped) when haproxy or nginx is not installed, unless
TREESERVE_REQUIRE_PROXY=1 (CI), which makes that a failure.
"""
import os
import re
import shutil
import subprocess
import sys
import time

BIN, SRC = sys.argv[1], sys.argv[2]
sys.path.insert(0, os.path.join(SRC, "clients", "python"))
sys.path.insert(0, os.path.join(SRC, "deploy"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

NGINX_CONF = os.path.join(SRC, "deploy", "nginx", "nginx.conf")


def skip_or_fail(why):
    print("proxy e2e test skipped: " + why)
    if os.environ.get("TREESERVE_REQUIRE_PROXY") == "1":
        print("TREESERVE_REQUIRE_PROXY=1: a skip is a failure")
        sys.exit(1)
    sys.exit(77)


for tool in ("haproxy", "nginx"):
    if not shutil.which(tool, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin"):
        skip_or_fail(tool + " is not installed (Debian: apt-get install haproxy nginx)")

import grpc  # noqa: E402
import grpc_health_frames  # noqa: E402
from local_replicas import NAMES as REPLICAS, ReplicaSet, free_port, wait_for  # noqa: E402
from treeserve import TreeServeClient, pb_grpc  # noqa: E402
from treeserve.routing import (REPLICA_HEADER, ROUTE_HEADER, replica_of_tree,  # noqa: E402
                               route_key, route_of_tree)


def check(cond, what):
    if not cond:
        raise AssertionError(what)


def misrouted(replica):
    values = replica.metrics()
    check("treeserve:misrouted_calls_total" in values,
          "replica %s exports no treeserve:misrouted_calls_total" % replica.name)
    return values["treeserve:misrouted_calls_total"]


class Nginx:
    def __init__(self, replicas, tmp):
        self.listen = "127.0.0.1:%d" % free_port()
        text = open(NGINX_CONF).read()
        for i, r in enumerate(replicas, 1):
            text, n = re.subn(r"\breplica-%d:50051\b" % i, r.address, text)
            check(n == 1, "nginx.conf has no server replica-%d:50051" % i)
        text, n = re.subn(r"listen 50051 http2;", "listen %s http2;" % self.listen, text)
        check(n == 1, "nginx.conf does not listen on 50051")
        prefix = os.path.join(tmp, "nginx")
        os.makedirs(prefix)
        conf = os.path.join(prefix, "nginx.conf")
        open(conf, "w").write(text)
        self.log = os.path.join(tmp, "nginx.log")
        nginx = shutil.which("nginx", path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                [nginx, "-p", prefix, "-c", conf, "-g", "daemon off; pid %s/nginx.pid;" % prefix],
                stdout=log, stderr=subprocess.STDOUT)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


class Recorder(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
               grpc.StreamStreamClientInterceptor):
    """Keeps every call the client makes: its method, the metadata it sent, and the call (whose
    initial metadata names the replica that answered)."""

    def __init__(self):
        self.calls = []

    def _keep(self, details, call):
        self.calls.append((details.method.rsplit("/", 1)[-1], dict(details.metadata or ()), call))
        return call

    def intercept_unary_unary(self, continuation, details, request):
        return self._keep(details, continuation(details, request))

    def intercept_unary_stream(self, continuation, details, request):
        return self._keep(details, continuation(details, request))

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return self._keep(details, continuation(details, request_iterator))


def answered_by(call):
    """The x-treeserve-replica a call's answer carried (initial metadata, or the trailers of an
    error sent as trailers only)."""
    for md in (call.initial_metadata(), call.trailing_metadata()):
        for k, v in md or ():
            if k == REPLICA_HEADER:
                return v
    return None


class Client:
    """The package's TreeServeClient on a proxy address, every call recorded."""

    def __init__(self, target):
        self.recorder = Recorder()
        self.c = TreeServeClient(target, timeout=30)
        self.c.stub = pb_grpc.TreeServeStub(grpc.intercept_channel(self.c.channel, self.recorder))

    def mark(self):
        return len(self.recorder.calls)

    def calls_since(self, mark):
        return self.recorder.calls[mark:]

    def expect_replica(self, mark, replica, route):
        """Every call since mark went out with x-treeserve-route = route and was answered by
        replica."""
        calls = self.calls_since(mark)
        check(calls, "no calls recorded")
        for method, sent, call in calls:
            check(sent.get(ROUTE_HEADER) == route, "%s sent %s=%r, not the tree's key %r" % (
                method, ROUTE_HEADER, sent.get(ROUTE_HEADER), route))
            got = answered_by(call)
            check(got == replica, "%s was answered by replica %r, not %r (the tree's)" % (
                method, got, replica))

    def generate(self, tree_id, branches, tokens):
        out = list(self.c.generate(tree_id, branches, max_tokens=tokens, temperature=0))
        check(len([m for m in out if m.token_id >= 0]) == tokens * len(branches),
              "generate gave %d messages" % len(out))


def tree_life(client, prompt):
    """Create, fork, generate, prune, get, delete: every call on the tree's replica."""
    mark = client.mark()
    t = client.c.create_tree(prompt)
    replica, route = replica_of_tree(t.tree_id), route_of_tree(t.tree_id)
    check(replica in REPLICAS, "tree id %s names no replica" % t.tree_id)
    check(route == route_key(prompt), "tree id %s carries route %s, not the prompt's %s" % (
        t.tree_id, route, route_key(prompt)))
    forks = client.c.branch(t.tree_id, t.root_branch_id, 3)
    client.generate(t.tree_id, forks, 6)
    client.c.prune(t.tree_id, forks[:1])
    info = client.c.get_tree(t.tree_id)
    check(info.live_branches == 3, "live branches %d after pruning 1 of 3 forks" %
          info.live_branches)
    client.c.delete_tree(t.tree_id)
    # CreateTree carries the prompt's key; every later call the id's (the same key).
    client.expect_replica(mark, replica, route)
    return replica


def trees_on_every_replica(client, live):
    """{replica: [tree id, ...]}: trees made with varied prompts until each live replica holds
    one (the prompt's key decides where a tree lands)."""
    trees = {r: [] for r in live}
    for i in range(60):
        mark = client.mark()
        t = client.c.create_tree("Tree number %d: a story about %s." % (i, "xyz"[i % 3] * i))
        r = replica_of_tree(t.tree_id)
        client.expect_replica(mark, r, route_of_tree(t.tree_id))
        trees[r].append(t)
        if all(trees.values()):
            return trees
    raise AssertionError("60 prompts did not reach every replica: %s" %
                         {r: len(v) for r, v in trees.items()})


def shared_prefix(client):
    """Prompts whose first 256 bytes agree share a key, so one replica, so its cache."""
    head = "You are a careful assistant. " * 12  # 348 bytes
    replicas, cached = set(), []
    for q in ("What is 2 + 2?", "Name a colour.", "Spell 'tree'.", "Count to three."):
        t = client.c.create_tree(head + q)
        replicas.add(replica_of_tree(t.tree_id))
        cached.append(t.cached_tokens)
        client.c.delete_tree(t.tree_id)
    check(len(replicas) == 1, "prompts sharing 256 bytes landed on %s" % sorted(replicas))
    check(all(c > 0 for c in cached[1:]), "later prompts reused no cache: %s" % cached)
    print("shared prefix: 4 prompts on %s, cached tokens %s" % (replicas.pop(), cached))


def main():
    rs = ReplicaSet(BIN)
    nginx = None
    ok = False
    try:
        rs.start()
        for r in rs.replicas:
            check(grpc_health_frames.serving(r.address),
                  "replica %s does not answer the proxy's health check" % r.name)
        print("haproxy: %s" % rs.servers())

        client = Client(rs.listen)
        placed = {tree_life(client, "Prompt %d about proxies and trees." % i) for i in range(6)}
        print("tree life cycle through haproxy: 6 trees on %s" % sorted(placed))
        trees = trees_on_every_replica(client, REPLICAS)
        for r, ts in trees.items():
            for t in ts:
                mark = client.mark()
                client.generate(t.tree_id, [t.root_branch_id], 4)
                client.c.get_tree(t.tree_id)
                client.expect_replica(mark, r, route_of_tree(t.tree_id))
        print("trees per replica: %s" % {r: len(ts) for r, ts in trees.items()})
        shared_prefix(client)
        for r in rs.replicas:
            check(misrouted(r) == 0, "replica %s counted misrouted calls" % r.name)

        nginx = Nginx(rs.replicas, rs.workdir)
        nclient = Client(nginx.listen)
        wait_for("nginx to answer", lambda: _answers(nclient), 20)
        placed = {tree_life(nclient, "Through nginx %d: trees and proxies." % i) for i in range(6)}
        print("tree life cycle through nginx: 6 trees on %s" % sorted(placed))
        for r in rs.replicas:
            check(misrouted(r) == 0, "replica %s counted misrouted calls (nginx)" % r.name)
        nginx.stop()

        # A replica stops.
        victim = max(trees, key=lambda r: len(trees[r]))
        live = [r for r in REPLICAS if r != victim]
        rs.kill(victim)
        killed = time.monotonic()
        wait_for("HAProxy to take %s out" % victim, lambda: rs.servers()[victim][0] == "DOWN", 15)
        print("haproxy took %s out %.1f s after SIGKILL" % (victim, time.monotonic() - killed))

        misroutes = 0
        for t in trees[victim]:
            for call in (lambda: client.c.get_tree(t.tree_id),
                         lambda: client.generate(t.tree_id, [t.root_branch_id], 2)):
                mark = client.mark()
                try:
                    call()
                    raise AssertionError("a call on %s (dead replica %s) succeeded" % (
                        t.tree_id, victim))
                except grpc.RpcError as e:
                    check(e.code() == grpc.StatusCode.FAILED_PRECONDITION,
                          "a call on the dead replica's tree: %s %s" % (e.code(), e.details()))
                    want = "lives on replica '%s', not on this replica" % victim
                    check(want in e.details(), "message %r lacks %r" % (e.details(), want))
                    check("x-treeserve-route: %s" % route_of_tree(t.tree_id) in e.details(),
                          "message %r does not name the route" % e.details())
                    # The error itself is the call (the interceptor keeps only an outcome).
                    check(client.calls_since(mark), "no call recorded")
                    got = answered_by(e)
                    check(got in live, "answered by %r, not a live replica" % got)
                misroutes += 1
        print("calls on %s's %d trees: FAILED_PRECONDITION naming it" % (victim,
                                                                         len(trees[victim])))
        for r in live:
            for t in trees[r]:
                mark = client.mark()
                client.generate(t.tree_id, [t.root_branch_id], 4)
                client.c.get_tree(t.tree_id)
                client.c.delete_tree(t.tree_id)
                client.expect_replica(mark, r, route_of_tree(t.tree_id))
        served = {}
        for i in range(20):
            prompt = "After the stop, request %d: %s" % (i, "tell me about %s." % ("ab" * i))
            mark = client.mark()
            t = client.c.create_tree(prompt)
            r = replica_of_tree(t.tree_id)
            check(r in live, "new tree %s on %r" % (t.tree_id, r))
            client.generate(t.tree_id, [t.root_branch_id], 2)
            client.c.delete_tree(t.tree_id)
            client.expect_replica(mark, r, route_of_tree(t.tree_id))
            served[r] = served.get(r, 0) + 1
        print("20 new trees after the stop: %s" % served)
        counted = sum(misrouted(rs.by_name(r)) for r in live)
        check(counted == misroutes, "live replicas counted %d misrouted calls, %d were made" % (
            counted, misroutes))

        unclean = rs.stop()
        check(not unclean, "replicas %s did not drain and exit 0" % unclean)
        ok = True
        print("proxy e2e OK")
    finally:
        if nginx:
            nginx.stop()
        rs.stop()
        if not ok:
            print(rs.logs())
        rs.cleanup()


def _answers(client):
    try:
        client.c.server_info()
        return True
    except grpc.RpcError:
        return False


if __name__ == "__main__":
    main()
