"""treeserve: Python clients for treeserve's gRPC API (treeserve.v1.TreeServe) and its HTTP
API (OpenAI's completions and the tree API as JSON; treeserve.http, standard library only).

    from treeserve import TreeServeClient, TreeServeHTTPClient
    c = TreeServeClient("127.0.0.1:50051")
    print(c.server_info())
    h = TreeServeHTTPClient("http://127.0.0.1:8000")
    print(h.completions("Once upon a time", max_tokens=16)["choices"][0]["text"])

Behind a proxy in front of several replicas, every call carries the header x-treeserve-route
(a tree's routing key, read from its id, or a new prompt's: route_key, route_of_tree), so the
proxy sends each call to the replica holding its tree (docs/api.md, "Routing across
replicas").

The gRPC stubs are the modules treeserve.treeserve_pb2 and treeserve.treeserve_pb2_grpc
(also `treeserve.pb`, `treeserve.pb_grpc`). An installed package carries them, generated
when it was built. Imported from a source checkout without installing (clients/python on
sys.path), the package generates them from the checkout's proto/treeserve.proto into
$TREESERVE_PY_STUBS (default /tmp/treeserve-py-stubs-UID) on first use.
"""
import os as _os

__version__ = "0.1.0"


def _find_stubs():
    here = _os.path.dirname(_os.path.abspath(__file__))
    if _os.path.isfile(_os.path.join(here, "treeserve_pb2.py")):
        return  # built into the package
    from . import _protogen
    try:
        proto = _protogen.find_proto(_os.path.dirname(here))
    except FileNotFoundError as e:
        raise ImportError("treeserve: the gRPC stubs (treeserve_pb2) are not in the package "
                          "and cannot be generated: %s. Install the package with pip from a "
                          "treeserve source tree (pip install clients/python)." % e)
    __path__.append(_protogen.cached_stubs(proto))


_find_stubs()

from .client import (BranchStream, TreeServeClient, collect_stream,  # noqa: E402
                     finish_reason_name, is_idle, kv_pages_in_use, pb, pb_grpc)
from .http import TreeServeHTTPClient, TreeServeHTTPError  # noqa: E402
from .routing import REPLICA_HEADER, ROUTE_HEADER, route_key, route_of_tree  # noqa: E402

__all__ = ["TreeServeClient", "TreeServeHTTPClient", "TreeServeHTTPError", "BranchStream",
           "collect_stream", "finish_reason_name", "is_idle", "kv_pages_in_use", "pb", "pb_grpc",
           "route_key", "route_of_tree", "ROUTE_HEADER", "REPLICA_HEADER", "__version__"]
