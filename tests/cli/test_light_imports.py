"""What must not import torch (seconds to load): `import unbroken`, `unbroken --version`,
and listing a run folder, `unbroken inspect --json RUN` (reading manifests is JSON).

Each runs in a fresh interpreter that reports afterwards which heavy modules it loaded.
"""

from __future__ import annotations

import json
import subprocess
import sys

import unbroken as ub

# Runs the real entry point with the given arguments, then reports whether torch came in
# and, if it did, the line of ours that imported it first.
_RUN = """
import json, sys, traceback

class Who:
    line = None

    def find_spec(self, name, path=None, target=None):
        if name == "torch" and self.line is None:
            ours = [f for f in traceback.extract_stack() if "/unbroken/" in f.filename]
            self.line = f"{ours[-1].filename}:{ours[-1].lineno}" if ours else "?"
        return None

who = Who()
sys.meta_path.insert(0, who)
sys.argv = ["unbroken", *sys.argv[1:]]
code = 0
if sys.argv[1:] == ["--import-only"]:
    import unbroken
else:
    from unbroken.cli import main
    try:
        main()
    except SystemExit as exc:
        code = exc.code or 0
print(json.dumps({"code": code, "torch": who.line}), file=sys.stderr)
"""


def _run(*args: object) -> tuple[dict, str]:
    done = subprocess.run([sys.executable, "-c", _RUN, *map(str, args)],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.stderr.strip(), done
    return json.loads(done.stderr.strip().splitlines()[-1]), done.stdout


def test_import_unbroken_loads_no_torch():
    assert _run("--import-only")[0] == {"code": 0, "torch": None}


def test_version_prints_the_version_without_torch():
    report, out = _run("--version")
    assert report == {"code": 0, "torch": None}
    assert out == f"unbroken {ub.__version__}\n"


def test_listing_a_run_folder_loads_no_torch(single_run):
    report, out = _run("inspect", "--json", single_run)
    assert report == {"code": 0, "torch": None}  # else: the line that imported torch
    assert [c["step"] for c in json.loads(out)["checkpoints"]] == [2, 4]
