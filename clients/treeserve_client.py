"""Small Python client for treeserve over its real gRPC API (treeserve.v1.TreeServe).

Uses Debian's python3-grpcio and python3-grpc-tools (run with /usr/bin/python3). The stubs
are generated from proto/treeserve.proto on first import into a cache folder, so the client
always matches the proto it sits beside.
"""
import importlib
import os
import sys
import tempfile

_HERE = os.path.dirname(os.path.abspath(__file__))
_PROTO_ROOT = os.path.normpath(os.path.join(_HERE, ".."))
_PROTO = os.path.join(_PROTO_ROOT, "proto", "treeserve.proto")


def _generated_dir():
    cache = os.environ.get("TREESERVE_PY_STUBS") or os.path.join(
        tempfile.gettempdir(), "treeserve-py-stubs-%d" % os.getuid())
    os.makedirs(cache, exist_ok=True)
    return cache


def _load_stubs():
    out = _generated_dir()
    pb2 = os.path.join(out, "proto", "treeserve_pb2.py")
    if not os.path.exists(pb2) or os.path.getmtime(pb2) < os.path.getmtime(_PROTO):
        from grpc_tools import protoc  # python3-grpc-tools
        rc = protoc.main(["protoc", "-I" + _PROTO_ROOT, "--python_out=" + out,
                          "--grpc_python_out=" + out, _PROTO])
        if rc != 0:
            raise RuntimeError("protoc failed on %s (exit %d)" % (_PROTO, rc))
        open(os.path.join(out, "proto", "__init__.py"), "a").close()
    if out not in sys.path:
        sys.path.insert(0, out)
    return (importlib.import_module("proto.treeserve_pb2"),
            importlib.import_module("proto.treeserve_pb2_grpc"))


pb, pb_grpc = _load_stubs()


class TreeServeClient:
    """Thin wrapper: one method per RPC, keyword arguments for the common fields."""

    def __init__(self, target="127.0.0.1:50051", auth_token=None, timeout=None):
        import grpc
        self._grpc = grpc
        self.channel = grpc.insecure_channel(target)
        self.stub = pb_grpc.TreeServeStub(self.channel)
        self.timeout = timeout
        self.metadata = [("authorization", "Bearer " + auth_token)] if auth_token else None

    def _call(self, method, request, timeout=None):
        return method(request, timeout=timeout or self.timeout, metadata=self.metadata)

    @staticmethod
    def prompt(text_or_ids):
        if isinstance(text_or_ids, str):
            return pb.Prompt(text=text_or_ids)
        return pb.Prompt(tokens=pb.TokenIds(ids=list(text_or_ids)))

    def tokenize(self, text):
        return list(self._call(self.stub.Tokenize, pb.TokenizeRequest(text=text)).ids)

    def detokenize(self, ids):
        return self._call(self.stub.Detokenize, pb.DetokenizeRequest(ids=list(ids))).text

    def server_info(self):
        return self._call(self.stub.GetServerInfo, pb.GetServerInfoRequest())

    def create_tree(self, prompt):
        return self._call(self.stub.CreateTree, pb.CreateTreeRequest(prompt=self.prompt(prompt)))

    def branch(self, tree_id, branch_id, n, at_offset=0):
        r = self._call(self.stub.Branch, pb.BranchRequest(
            tree_id=tree_id, branch_id=branch_id, n=n, at_offset=at_offset))
        return list(r.branch_ids)

    def generate(self, tree_id="", branch_ids=(), append=None, prompt=None, n=0, timeout=None,
                 **sampling):
        """Yields GenerateResponse messages as they stream in."""
        req = pb.GenerateRequest(tree_id=tree_id, branch_ids=list(branch_ids), n=n,
                                 sampling=pb.SamplingParams(**sampling))
        if append is not None:
            req.append.CopyFrom(self.prompt(append))
        if prompt is not None:
            req.prompt.CopyFrom(self.prompt(prompt))
        return self.stub.Generate(req, timeout=timeout or self.timeout, metadata=self.metadata)

    def prune(self, tree_id, branch_ids, retain_kv=False):
        return self._call(self.stub.Prune, pb.PruneRequest(
            tree_id=tree_id, branch_ids=list(branch_ids), retain_kv=retain_kv))

    def verify(self, tree_id, branch_id, tokens, parents, **sampling):
        return self._call(self.stub.Verify, pb.VerifyRequest(
            tree_id=tree_id, branch_id=branch_id, tokens=list(tokens), parents=list(parents),
            sampling=pb.SamplingParams(**sampling)))

    def get_tree(self, tree_id):
        return self._call(self.stub.GetTree, pb.GetTreeRequest(tree_id=tree_id))

    def delete_tree(self, tree_id):
        return self._call(self.stub.DeleteTree, pb.DeleteTreeRequest(tree_id=tree_id))
