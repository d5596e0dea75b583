"""Build step of the treeserve package: build_py also generates the gRPC stubs from the
repository's proto/treeserve.proto (or $TREESERVE_PROTO) into the built package, so the
installed package imports them as treeserve.treeserve_pb2 and treeserve.treeserve_pb2_grpc.
Everything else is in pyproject.toml."""
import importlib.util
import os
import shutil
import sys

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))


def _protogen():
    # Loaded by path: importing the treeserve package itself would need the stubs.
    path = os.path.join(HERE, "treeserve", "_protogen.py")
    spec = importlib.util.spec_from_file_location("_treeserve_protogen", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class BuildPyWithStubs(build_py):
    def run(self):
        # pip builds a local directory in place: start from an empty build/lib/treeserve, so
        # a module removed from the sources does not linger in the wheel.
        gen = _protogen()
        try:
            proto = gen.find_proto(HERE)
        except FileNotFoundError as e:
            sys.exit("error: treeserve package build: %s" % e)
        shutil.rmtree(os.path.join(self.build_lib, "treeserve"), ignore_errors=True)
        super().run()
        out = os.path.join(self.build_lib, "treeserve")
        self.announce("generating gRPC stubs from %s into %s" % (proto, out), level=2)
        try:
            gen.generate(proto, out)
        except RuntimeError as e:
            sys.exit("error: treeserve package build: %s" % e)

    def get_outputs(self, include_bytecode=True):
        out = os.path.join(self.build_lib, "treeserve")
        return super().get_outputs(include_bytecode) + [
            os.path.join(out, name) for name in _protogen().STUB_FILES]


setup(cmdclass={"build_py": BuildPyWithStubs})
