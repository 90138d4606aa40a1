"""The layering that keeps processes light: the HTTP process and the CLI never load torch, the
package root imports lazily, and training does not import the server.

Each check runs in a fresh interpreter, since this one has long imported everything.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
# what makes an import slow (seconds for torch) or belongs to another process
HEAVY = ("torch", "triton", "numpy", "safetensors", "transformers", "fastapi", "uvicorn")


def loaded_after(code: str) -> set[str]:
    """Top-level packages in sys.modules after running `code` in a fresh interpreter."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))
    probe = code + "\nimport json, sys\nprint(json.dumps(sorted({m.split('.')[0] for m in sys.modules} "
    probe += "| {m for m in sys.modules if m.startswith('flashtree')})))"
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env,
                       cwd=REPO_ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    return set(json.loads(r.stdout.strip().splitlines()[-1]))


def test_http_process_does_not_import_torch():
    """Everything the server process imports, every flashtree.serve module included (the worker
    module too: only its process entry function imports the engine)."""
    loaded = loaded_after(
        "import pkgutil, importlib, flashtree.serve\n"
        "for m in pkgutil.iter_modules(flashtree.serve.__path__):\n"
        "    importlib.import_module('flashtree.serve.' + m.name)\n"
        "import flashtree.cli\n"
        "flashtree.cli.build_parser(['serve'])")
    assert "flashtree.serve.app" in loaded and "flashtree.serve.worker" in loaded
    assert "torch" not in loaded and "flashtree.runtime" not in loaded


def test_import_cli_is_fast_and_torch_free():
    """Fast as in: nothing heavy is imported, which is what made it take seconds (speed itself
    is not timed in tests; README's import-time numbers come from `python -X importtime`)."""
    loaded = loaded_after("import flashtree.cli")
    assert not loaded & set(HEAVY), sorted(loaded & set(HEAVY))
    assert not any(m.startswith(("flashtree.bench", "flashtree.train", "flashtree.serve.app")) for m in loaded)


def test_package_root_imports_lazily():
    loaded = loaded_after("import flashtree\nfrom flashtree import SamplingParams\nSamplingParams(top_p=0.5).validate()")
    assert "torch" not in loaded
    import flashtree
    from flashtree.runtime.engine import Engine

    assert flashtree.Engine is Engine and "Engine" in dir(flashtree)
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        flashtree.Nope


def test_training_data_does_not_import_the_server():
    loaded = loaded_after("import flashtree.train.corpus")
    assert not any(m.startswith("flashtree.serve") for m in loaded)
