"""Builds the one compiled part, the host kernel of the fingerprint (optional: without a
compiler the package installs and computes the same digests with torch ops, slower)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "unbroken.format.mix64_kernel",
            ["src/unbroken/format/mix64_kernel.c"],
            extra_compile_args=["-O3"],
            optional=True,
        )
    ]
)
