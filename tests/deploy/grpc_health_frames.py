"""The bytes of HAProxy's active check (deploy/haproxy/haproxy.cfg, backend treeserve): one
gRPC call grpc.health.v1.Health/Check written as raw HTTP/2 frames, because HAProxy 2.6's
http-check cannot send a body that holds zero bytes. This module builds those frames from
their parts, so the hex in the config is checked against what it claims to be, and can send
them to a live server.

    python3 grpc_health_frames.py CONFIG              # the config's hex equals request_frames()
    python3 grpc_health_frames.py CONFIG HOST:PORT    # ... and a live server answers SERVING

Standard library only.
"""
import re
import socket
import sys
import time

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
PATH = b"/grpc.health.v1.Health/Check"
AUTHORITY = b"localhost"
# The answer's gRPC message: uncompressed, 2 bytes long, field 1 (status) = SERVING (1).
SERVING_MESSAGE = bytes.fromhex("00000000020801")
ANY_ANSWER = SERVING_MESSAGE[:6]  # the same up to the status value


def frame(kind, flags, stream, payload):
    """An HTTP/2 frame: 24-bit length, type, flags, 31-bit stream id, payload (RFC 9113 4.1)."""
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream.to_bytes(4, "big") + \
        payload


def literal(index, value):
    """HPACK "literal header field without indexing", name from the static table (RFC 7541
    6.2.2; 4-bit prefix integer), value a plain string (no Huffman; lengths < 127)."""
    name = bytes([index]) if index < 15 else bytes([0x0F, index - 15])
    return name + bytes([len(value)]) + value


def literal_new_name(name, value):
    """The same with a literal name (index 0)."""
    return bytes([0, len(name)]) + name + bytes([len(value)]) + value


def request_frames():
    """The check's four writes: preface, SETTINGS, HEADERS, DATA (one send-binary each)."""
    header_block = (bytes([0x83, 0x86])          # :method POST, :scheme http (static 3, 6)
                    + literal(4, PATH)           # :path
                    + literal(1, AUTHORITY)      # :authority (gRPC servers require one)
                    + literal(31, b"application/grpc")  # content-type
                    + literal_new_name(b"te", b"trailers"))
    return [
        PREFACE,
        frame(0x4, 0, 0, b""),                       # SETTINGS, none changed
        frame(0x1, 0x4, 1, header_block),            # HEADERS, END_HEADERS
        frame(0x0, 0x1, 1, bytes(5)),                # DATA, END_STREAM: an empty message
    ]


def config_frames(config_text):
    """The send-binary hex strings of a HAProxy config, in order, as bytes."""
    return [bytes.fromhex(h) for h in
            re.findall(r"^\s*tcp-check send-binary ([0-9a-fA-F]+)", config_text, re.M)]


def config_expects(config_text):
    return [bytes.fromhex(h) for h in
            re.findall(r"^\s*tcp-check expect (?:min-recv \d+ )?binary ([0-9a-fA-F]+)", config_text, re.M)]


def ask(address, timeout=2.0):
    """Sends the check to HOST:PORT; returns the bytes read until the answer holds a
    HealthCheckResponse (or the timeout)."""
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.sendall(b"".join(request_frames()))
        data = b""
        end = time.monotonic() + timeout
        while ANY_ANSWER not in data and time.monotonic() < end:
            s.settimeout(max(0.01, end - time.monotonic()))
            try:
                chunk = s.recv(65536)
            except socket.timeout:
                break
            if not chunk:
                break
            data += chunk
        return data


def serving(address, timeout=2.0):
    """True when the server at HOST:PORT answers the check with SERVING."""
    return SERVING_MESSAGE in ask(address, timeout)


def main(argv):
    config = open(argv[1]).read()
    got, want = config_frames(config), request_frames()
    if got != want:
        print("the config's tcp-check send-binary lines are not the request this module builds")
        print("config:  " + " | ".join(b.hex() for b in got))
        print("request: " + " | ".join(b.hex() for b in want))
        return 1
    if config_expects(config) != [ANY_ANSWER, SERVING_MESSAGE]:
        print("the config's tcp-check expect lines are not", ANY_ANSWER.hex(),
              SERVING_MESSAGE.hex())
        return 1
    print("health check frames OK (%d bytes)" % sum(len(b) for b in want))
    if len(argv) > 2:
        answer = ask(argv[2])
        if SERVING_MESSAGE not in answer:
            print("%s did not answer SERVING: %s" % (argv[2], answer.hex()))
            return 1
        print("%s answers SERVING" % argv[2])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
