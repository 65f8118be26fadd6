"""Builds the one compiled part, the host kernel of the fingerprint (optional: without a
compiler the package installs and computes the same digests with torch ops, slower)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "unbroken.format._mix64",
            ["src/unbroken/format/_mix64.c"],
            extra_compile_args=["-O3"],
            optional=True,
        )
    ]
)
