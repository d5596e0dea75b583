"""Routing across replicas (docs/api.md, "Routing across replicas"): the routing key a call
carries in the header x-treeserve-route, so that a proxy hashing that header sends every call
of a tree, and prompts sharing a prefix, to one replica. Standard library only; the server and
the C++ load client compute the same keys (common/route_key.h; tests/common checks both on the
same vectors).

    route_key("Once upon a time")           # a text prompt: '779b5c6d83ca1888'
    route_key([1, 15043, 3186])             # token ids
    route_key(messages=[{"role": "user", "content": "Hi"}])
    route_of_tree("t_3f2a9c0d1e2b4a5c.r1.9a8b7c6d.0123...")  # '3f2a9c0d1e2b4a5c'

A tree id is t_<route>.<replica>.<incarnation>.<32 hex digits>: the tree's routing key, the
replica that holds it, and that replica's run.
"""
import hashlib

ROUTE_HEADER = "x-treeserve-route"
REPLICA_HEADER = "x-treeserve-replica"
ROUTE_PREFIX_BYTES = 256  # N: bytes of a text (or of the messages) hashed
ROUTE_PREFIX_IDS = 64     # M: token ids hashed


def _key(canonical):
    return hashlib.sha256(canonical).hexdigest()[:16]


def _content_text(content):
    """A message's content as the server sees it: a string, or OpenAI's text parts joined by
    newlines (None: empty)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n".join(part["text"] for part in content)


def route_key(prompt=None, messages=None, route_prefix_bytes=ROUTE_PREFIX_BYTES,
              route_prefix_ids=ROUTE_PREFIX_IDS):
    """The routing key of a prompt: the first 16 hex digits of the SHA-256 of
    "text:" + its first route_prefix_bytes bytes (UTF-8), "ids:" + its first route_prefix_ids
    token ids joined by ",", or, for chat messages ({"role", "content"} dicts or objects with
    those attributes), "messages:" + the first route_prefix_bytes bytes of role "\\n" content
    "\\n" over the messages in order."""
    if messages is not None:
        joined = b""
        for m in messages:
            role = m["role"] if isinstance(m, dict) else m.role
            content = m.get("content") if isinstance(m, dict) else m.content
            joined += (role + "\n" + _content_text(content) + "\n").encode("utf-8")
            if len(joined) >= route_prefix_bytes:
                break
        return _key(b"messages:" + joined[:route_prefix_bytes])
    if isinstance(prompt, str):
        return _key(b"text:" + prompt.encode("utf-8")[:route_prefix_bytes])
    if prompt is None:
        raise ValueError("route_key: give a prompt (text or token ids) or messages")
    ids = list(prompt)[:route_prefix_ids]
    return _key(("ids:" + ",".join(str(int(i)) for i in ids)).encode("ascii"))


def route_of_tree(tree_id):
    """The routing key a tree id carries (t_<route>.<replica>.<incarnation>.<random>: read from
    the right, as a route may hold dots); None for an id of another form."""
    if not tree_id.startswith("t_"):
        return None
    parts = tree_id[2:].rsplit(".", 3)
    if len(parts) != 4 or not parts[0]:
        return None
    return parts[0]


def replica_of_tree(tree_id):
    """The replica a tree id names, or None for an id of another form."""
    if route_of_tree(tree_id) is None:
        return None
    return tree_id[2:].rsplit(".", 3)[1]
