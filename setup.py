"""Build hook: generate the protocol's code into the build (the wheel), from protos/.

Everything else is in pyproject.toml. An editable install (``pip install -e .``) builds nothing
into the source tree; ``make proto`` generates it there.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PROTO = "protos/ps/net/proto/hps.proto"


class BuildPyWithProto(build_py):
    def run(self) -> None:
        super().run()
        from grpc_tools import protoc  # a build requirement (pyproject.toml)

        out = Path(self.build_lib)
        (out / "ps" / "net" / "proto").mkdir(parents=True, exist_ok=True)
        args = ["grpc_tools.protoc", "-Iprotos", f"--python_out={out}", f"--grpc_python_out={out}",
                f"--pyi_out={out}", PROTO]
        if protoc.main(args) != 0:
            raise SystemExit(f"protoc failed on {PROTO}")


setup(cmdclass={"build_py": BuildPyWithProto})
