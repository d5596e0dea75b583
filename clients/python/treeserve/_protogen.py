"""Generates the gRPC stubs (treeserve_pb2.py, treeserve_pb2_grpc.py) from treeserve.proto.

Used by the package build (setup.py's build_py step writes them into the package) and, in a
source checkout where the package is not installed, by treeserve/__init__.py (which writes
them into a cache folder). Needs only grpc_tools (Debian: python3-grpc-tools).

The proto is compiled as `treeserve/treeserve.proto` (a copy in a staging folder), so the
generated grpc module imports its messages as `from treeserve import treeserve_pb2`.
"""
import hashlib
import os
import shutil
import tempfile

PROTO_ENV = "TREESERVE_PROTO"
STUB_FILES = ("treeserve_pb2.py", "treeserve_pb2_grpc.py")


def find_proto(project_dir):
    """The path of treeserve.proto: $TREESERVE_PROTO when set, else the repository's
    proto/treeserve.proto two folders above `project_dir` (clients/python). Raises
    FileNotFoundError with a message naming both when neither exists."""
    env = os.environ.get(PROTO_ENV)
    if env:
        path = os.path.abspath(env)
        if os.path.isdir(path):
            path = os.path.join(path, "treeserve.proto")
        if not os.path.isfile(path):
            raise FileNotFoundError("%s=%s: no treeserve.proto there" % (PROTO_ENV, env))
        return path
    path = os.path.normpath(os.path.join(project_dir, "..", "..", "proto", "treeserve.proto"))
    if not os.path.isfile(path):
        raise FileNotFoundError(
            "treeserve.proto not found at %s (the package is built from a treeserve "
            "source tree: clients/python and proto/ under one root); set %s to the path "
            "of treeserve.proto" % (path, PROTO_ENV))
    return path


def proto_digest(proto):
    with open(proto, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def generate(proto, out_dir):
    """Compiles `proto` into `out_dir`/treeserve_pb2.py and treeserve_pb2_grpc.py."""
    try:
        from grpc_tools import protoc
    except ImportError as e:
        raise RuntimeError("generating the treeserve gRPC stubs needs grpc_tools (Debian: "
                           "apt-get install python3-grpc-tools; pip: grpcio-tools): %s" % e)
    with tempfile.TemporaryDirectory(prefix="treeserve-protoc-") as tmp:
        src = os.path.join(tmp, "src")
        gen = os.path.join(tmp, "gen")
        os.makedirs(os.path.join(src, "treeserve"))
        os.makedirs(gen)
        staged = os.path.join(src, "treeserve", "treeserve.proto")
        shutil.copyfile(proto, staged)
        rc = protoc.main(["protoc", "-I" + src, "--python_out=" + gen,
                          "--grpc_python_out=" + gen, staged])
        if rc != 0:
            raise RuntimeError("protoc failed on %s (exit %d)" % (proto, rc))
        os.makedirs(out_dir, exist_ok=True)
        for name in STUB_FILES:
            shutil.copyfile(os.path.join(gen, "treeserve", name), os.path.join(out_dir, name))


def cached_stubs(proto):
    """A folder holding stubs generated from `proto`: `$TREESERVE_PY_STUBS` (default
    /tmp/treeserve-py-stubs-UID) / the first 16 hex digits of the proto's sha256. Generated
    on first use into a temporary folder that is then renamed into place, so concurrent
    first uses and edits of the proto never see a partial or stale pair."""
    root = os.environ.get("TREESERVE_PY_STUBS") or os.path.join(
        tempfile.gettempdir(), "treeserve-py-stubs-%d" % os.getuid())
    final = os.path.join(root, proto_digest(proto)[:16])
    if all(os.path.isfile(os.path.join(final, n)) for n in STUB_FILES):
        return final
    os.makedirs(root, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".gen-", dir=root)
    try:
        generate(proto, tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not all(os.path.isfile(os.path.join(final, n)) for n in STUB_FILES):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
