"""The compiled part of the package: kvrail._ring_native, the ring's hot path
with real atomics (kvrail/ring.py says when it is used). Optional: without a
C compiler or Python's headers the package installs without it, and rings
use the pure-Python path (x86-64 only) or gRPC."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvrail._ring_native",
            ["src/kvrail/_ring_native.c"],
            extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wextra"],
            optional=True,
        )
    ]
)
